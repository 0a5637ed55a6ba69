"""What the tensor-parallel driver tells its workers each call: a fixed header, then the call's integers
as one int64 tensor and its hidden rows as one float tensor, each sent by a torch.distributed broadcast
from rank 0 (three collectives at most, no pickles on the step path)."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltaserve.model.context import CacheTensors, ForwardContext

HEADER_LEN = 4  # command, number of integers, number of hidden rows, argument (the MTP pass)


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


def send(msg: Message) -> None:
    """Rank 0's side of a call."""
    rows = 0 if msg.hidden is None else msg.hidden.shape[0]
    header = torch.tensor([int(msg.command), msg.ints.numel(), rows, msg.arg], dtype=torch.long)
    dist.broadcast(header, src=0)
    if msg.ints.numel():
        dist.broadcast(msg.ints.contiguous(), src=0)
    if rows:
        dist.broadcast(msg.hidden.contiguous(), src=0)


def receive(hidden_size: int, dtype: torch.dtype) -> Message:
    """A worker's side: waits for the driver's next call."""
    header = torch.empty(HEADER_LEN, dtype=torch.long)
    dist.broadcast(header, src=0)
    command, n, rows, arg = header.tolist()
    ints = torch.empty(n, dtype=torch.long)
    if n:
        dist.broadcast(ints, src=0)
    hidden = None
    if rows:
        hidden = torch.empty(rows, hidden_size, dtype=dtype)
        dist.broadcast(hidden, src=0)
    return Message(Command(command), ints, hidden, arg)


def pack_step(input_ids: torch.Tensor, ctx: ForwardContext, output_rows: torch.Tensor | None = None) -> torch.Tensor:
    """A paged step as integers: [B, T, W, has_verify, R] then input ids, positions, query_start_loc,
    context lens, block tables, state slots, slot mapping, verify flags, output rows."""
    if ctx.cache is None or ctx.positions.dim() != 1:
        raise ValueError("tensor parallelism runs the engine's paged steps only (1-D positions, a cache)")
    B, T = ctx.num_seqs, input_ids.numel()
    W = ctx.block_tables.shape[1]
    R = -1 if output_rows is None else output_rows.numel()
    verify = ctx.verify or []
    head = [B, T, W, int(ctx.verify is not None), R]
    parts = [
        torch.tensor(head + ctx.query_start_loc + ctx.context_lens + [int(v) for v in verify], dtype=torch.long),
        input_ids.reshape(-1), ctx.positions, ctx.block_tables.reshape(-1), ctx.state_slots, ctx.slot_mapping,
    ]
    if output_rows is not None:
        parts.append(output_rows.reshape(-1))
    return torch.cat([p.to(torch.long) for p in parts])


def unpack_step(ints: torch.Tensor, cache: CacheTensors) -> tuple[torch.Tensor, ForwardContext, torch.Tensor | None]:
    """pack_step's inverse over this rank's own cache: input ids, the context, output rows (or None)."""
    B, T, W, has_verify, R = ints[:5].tolist()
    at = 5
    small = ints[at : at + (B + 1) + B + (B if has_verify else 0)].tolist()
    at += len(small)
    qsl, context_lens = small[: B + 1], small[B + 1 : 2 * B + 1]
    verify = [bool(v) for v in small[2 * B + 1 :]] if has_verify else None

    def take(n: int) -> torch.Tensor:
        nonlocal at
        at += n
        return ints[at - n : at]

    input_ids, positions = take(T), take(T)
    block_tables = take(B * W).view(B, W)
    state_slots, slot_mapping = take(B), take(T)
    output_rows = take(R) if R >= 0 else None
    ctx = ForwardContext(
        positions=positions, query_start_loc=qsl, context_lens=context_lens, cache=cache,
        block_tables=block_tables, state_slots=state_slots, slot_mapping=slot_mapping, verify=verify,
    )
    return input_ids, ctx, output_rows


def cache_bytes(cache: CacheTensors) -> int:
    """Bytes of every tensor a rank's cache holds: K/V blocks (and fp8 scales), conv and recurrent state slots."""
    return sum(t.numel() * t.element_size() for t in cache.tensors())


def collective_timeout_s() -> float:
    """How long a rank waits in one collective before it gives up (DELTASERVE_TP_TIMEOUT, seconds). An idle
    driver sends a heartbeat well within it, so only a rank that stopped answering runs into it."""
    return float(os.environ.get("DELTASERVE_TP_TIMEOUT", "120"))


BACKEND = "gloo"  # the model computes on the CPU; NCCL would need the tensors on a CUDA device
