"""What the tensor-parallel driver tells its workers each call: a fixed header, then the call's integers
as one int64 tensor and its hidden rows as one float tensor (an MTP pass's trunk hidden; a step's merged
image tokens, computed by rank 0's vision tower, for its placeholders' rows), each sent by a
torch.distributed broadcast from rank 0 (three collectives at most, no pickles on the step path). The
integers begin with the GDN snapshot copies of prefix caching that the driver's cache manager made since its
last call (scheduling restores a hit's snapshot into a slot, the step after it saves a slot): every rank
replays them on its own states before it runs the call."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltaserve.cache.snapshots import SnapshotStore
from deltaserve.model.context import CacheTensors, ForwardContext

HEADER_LEN = 5  # command, number of integers, number of hidden rows, argument (the MTP pass), snapshot copies
NO_COPIES = torch.zeros(0, 3, dtype=torch.long)


class Command(enum.IntEnum):
    FORWARD = 1
    LOGITS = 2  # compute_logits and greedy_tokens: the driver takes the argmax of the gathered logits
    MTP = 3
    COMMIT = 4
    CACHE_BYTES = 5  # each rank's allocated cache bytes, gathered (the planner's test)
    HEARTBEAT = 6  # the driver is idle but alive: workers wait for the next call
    STOP = 7


@dataclass(slots=True)
class Message:
    command: Command
    ints: torch.Tensor  # int64 [n]
    hidden: torch.Tensor | None = None  # [rows, H] in the model dtype
    arg: int = 0
    copies: torch.Tensor = NO_COPIES  # int64 [n, 3]: GDN snapshot copies to replay first (SnapshotStore)


def send(msg: Message) -> None:
    """Rank 0's side of a call."""
    rows = 0 if msg.hidden is None else msg.hidden.shape[0]
    copies = msg.copies.shape[0]
    header = torch.tensor([int(msg.command), msg.ints.numel(), rows, msg.arg, copies], dtype=torch.long)
    dist.broadcast(header, src=0)
    ints = torch.cat([msg.copies.reshape(-1), msg.ints]) if copies else msg.ints
    if ints.numel():
        dist.broadcast(ints.contiguous(), src=0)
    if rows:
        dist.broadcast(msg.hidden.contiguous(), src=0)


def receive(hidden_size: int, dtype: torch.dtype) -> Message:
    """A worker's side: waits for the driver's next call."""
    header = torch.empty(HEADER_LEN, dtype=torch.long)
    dist.broadcast(header, src=0)
    command, n, rows, arg, copies = header.tolist()
    ints = torch.empty(3 * copies + n, dtype=torch.long)
    if ints.numel():
        dist.broadcast(ints, src=0)
    hidden = None
    if rows:
        hidden = torch.empty(rows, hidden_size, dtype=dtype)
        dist.broadcast(hidden, src=0)
    return Message(Command(command), ints[3 * copies :], hidden, arg, ints[: 3 * copies].view(copies, 3))


def pack_step(input_ids: torch.Tensor, ctx: ForwardContext, output_rows: torch.Tensor | None = None,
              mm_rows: torch.Tensor | None = None) -> torch.Tensor:
    """A paged step as integers: [B, T, W, has_verify, R, P, M] then query_start_loc, context lens, verify
    flags, input ids, positions (P = 1 row, or 3 for mRoPE [3, T]), block tables, state slots, slot mapping,
    output rows, and the M rows whose embeddings an image's merged tokens replace (mm_rows; M = -1 without
    them: the embeddings themselves travel as the call's hidden rows)."""
    pos = ctx.positions
    if ctx.cache is None or not (pos.dim() == 1 or (pos.dim() == 2 and pos.shape[0] == 3)):
        raise ValueError("tensor parallelism runs the engine's paged steps only ([T] or [3, T] positions, a cache)")
    B, T = ctx.num_seqs, input_ids.numel()
    W = ctx.block_tables.shape[1]
    R = -1 if output_rows is None else output_rows.numel()
    P = 1 if pos.dim() == 1 else 3
    M = -1 if mm_rows is None else mm_rows.numel()
    verify = ctx.verify or []
    head = [B, T, W, int(ctx.verify is not None), R, P, M]
    parts = [
        torch.tensor(head + ctx.query_start_loc + ctx.context_lens + [int(v) for v in verify], dtype=torch.long),
        input_ids.reshape(-1), pos.reshape(-1), ctx.block_tables.reshape(-1), ctx.state_slots,
        ctx.slot_mapping,
    ]
    if output_rows is not None:
        parts.append(output_rows.reshape(-1))
    if mm_rows is not None:
        parts.append(mm_rows.reshape(-1))
    return torch.cat([p.to(torch.long) for p in parts])


def unpack_step(ints: torch.Tensor, cache: CacheTensors, mm_embeds: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, ForwardContext, torch.Tensor | None]:
    """pack_step's inverse over this rank's own cache: input ids, the context (with mm_embeds, the call's
    hidden rows, at the packed rows), output rows (or None)."""
    B, T, W, has_verify, R, P, M = ints[:7].tolist()
    at = 7
    small = ints[at : at + (B + 1) + B + (B if has_verify else 0)].tolist()
    at += len(small)
    qsl, context_lens = small[: B + 1], small[B + 1 : 2 * B + 1]
    verify = [bool(v) for v in small[2 * B + 1 :]] if has_verify else None

    def take(n: int) -> torch.Tensor:
        nonlocal at
        at += n
        return ints[at - n : at]

    input_ids = take(T)
    positions = take(T) if P == 1 else take(P * T).view(P, T)
    block_tables = take(B * W).view(B, W)
    state_slots, slot_mapping = take(B), take(T)
    output_rows = take(R) if R >= 0 else None
    mm_rows = take(M) if M >= 0 else None
    if (mm_rows is None) != (mm_embeds is None) or (mm_embeds is not None and mm_embeds.shape[0] != M):
        raise RuntimeError(f"a step with {M} image rows came with {None if mm_embeds is None else mm_embeds.shape[0]} "
                           "embedding rows")
    ctx = ForwardContext(
        positions=positions, query_start_loc=qsl, context_lens=context_lens, cache=cache,
        block_tables=block_tables, state_slots=state_slots, slot_mapping=slot_mapping, verify=verify,
        mm_embeds=None if mm_rows is None else (mm_rows, mm_embeds),
    )
    return input_ids, ctx, output_rows


def cache_bytes(cache: CacheTensors, snapshots: SnapshotStore | None) -> int:
    """Bytes of every tensor a rank's cache holds: K/V blocks (and fp8 scales), conv and recurrent state slots,
    and the GDN snapshots of prefix caching."""
    return sum(t.numel() * t.element_size() for t in cache.tensors()) + (0 if snapshots is None else snapshots.nbytes)


def collective_timeout_s() -> float:
    """How long a rank waits in one collective before it gives up (DELTASERVE_TP_TIMEOUT, seconds). An idle
    driver sends a heartbeat well within it, so only a rank that stopped answering runs into it."""
    return float(os.environ.get("DELTASERVE_TP_TIMEOUT", "120"))


BACKEND = "gloo"  # the model computes on the CPU; NCCL would need the tensors on a CUDA device
