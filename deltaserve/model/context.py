"""What one forward needs to know about the flat batch: where each sequence starts, how much of it is
already cached, and the cache tensors themselves. The model reads this; it never allocates cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn


@dataclass(slots=True)
class CacheTensors:
    """Cache storage for every layer. Attention layers (and the MTP layer) page K/V in blocks; GDN layers
    keep one state slot per running sequence."""

    # layer id -> k [num_blocks, nkv, hd, block_size], v [num_blocks, block_size, nkv, hd] (ops/attention.py)
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    conv: dict[int, torch.Tensor]  # GDN layer id -> [num_slots, conv_dim, K-1]
    ssm: dict[int, torch.Tensor]  # GDN layer id -> [num_slots, Hv, dk, dv] (fp32)
    # fp8 K/V only: layer id -> fp32 k_scale [num_blocks, nkv, block_size], v_scale [num_blocks, block_size,
    # nkv], one per (token, kv head) (ops/attention.py); empty for other dtypes
    kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds: K/V blocks and their scales, conv and recurrent state slots."""
        pairs = [*self.kv.values(), *self.kv_scales.values()]
        return [t for pair in pairs for t in pair] + list(self.conv.values()) + list(self.ssm.values())

    @property
    def block_size(self) -> int:
        return next(iter(self.kv.values()))[1].shape[1] if self.kv else 1


class ForwardTrace(Protocol):
    """An observer of one forward (the inspector, deltaserve/inspect). The model calls it only where
    ctx.trace is set, so a serving forward pays one `is None` check per layer and mixer, nothing more."""

    def layer(self, layer_id: int, x: torch.Tensor, mix: torch.Tensor, ffn: torch.Tensor) -> None: ...

    def gdn(self, mixer: nn.Module, qkv: torch.Tensor, z: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor) -> None: ...

    def attention(self, mixer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  gate: torch.Tensor) -> None: ...


@dataclass(slots=True)
class DecodeBatch:
    """The sequences of a cached forward that bring exactly one new token (decode_seqs), as tensors."""

    tokens: torch.Tensor  # [D] token index of each
    keep: torch.Tensor  # [D] 1.0 = continue the cached GDN state, 0.0 = fresh start
    slots: torch.Tensor  # [D] GDN state slot
    seq_lens: torch.Tensor  # [D] cached + new tokens
    block_tables: torch.Tensor  # [D, max_blocks]


@dataclass(slots=True)
class ForwardContext:
    """A flat batch of B sequences, T tokens in all. Sequence b owns tokens
    query_start_loc[b] : query_start_loc[b+1]; context_lens[b] of its tokens were cached by earlier
    steps (0 = a fresh sequence, whose GDN state starts from zeros whatever its slot holds).

    With `cache` None the forward is stateless: every sequence is fresh and complete, nothing is
    stored (training, tracing). Stateless batches of equal lengths run as one [B, L] batch."""

    positions: torch.Tensor  # [T] (or [3, T] for multimodal RoPE)
    query_start_loc: list[int]  # [B + 1]
    context_lens: list[int]  # [B]
    cache: CacheTensors | None = None
    block_tables: torch.Tensor | None = None  # [B, max_blocks] long, padded
    state_slots: torch.Tensor | None = None  # [B] long
    slot_mapping: torch.Tensor | None = None  # [T] long: flat KV row of each new token
    # Multimodal prompts: (rows [R] long, embeddings [R, H]) that replace the token embeddings at those rows
    # (the vision tower's merged tokens where the prompt has image placeholders).
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    trace: ForwardTrace | None = None  # set only by the inspector's own forwards, never by the engine
    # Per sequence: a speculative verify segment (last sampled token + drafts). Attention treats it as a
    # short chunk; GDN layers keep the state after every position in spec_states instead of committing,
    # because only the engine knows, after acceptance, which position's state is the right one.
    verify: list[bool] | None = None
    # derived in __post_init__
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    decode_seqs: list[int] = field(default_factory=list)  # sequences with exactly one new token
    prefill_seqs: list[int] = field(default_factory=list)  # the others (prompt chunks)
    _decode: DecodeBatch | None = field(default=None, init=False, repr=False)  # see `decode`
    spec_seqs: list[int] = field(default_factory=list)  # verify segments (never fresh)
    spec_tokens: torch.Tensor | None = None  # [S, L] token index per position, padded with the last one
    spec_valid: torch.Tensor | None = None  # [S, L] bool: real (not padding) positions
    # GDN layer id -> (conv [S, L, conv_dim, K-1], recurrent [S, L, Hv, dk, dv]) after each position
    spec_states: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    uniform_len: int = 0  # stateless batch whose sequences all have this length (else 0)

    def __post_init__(self) -> None:
        qsl = self.query_start_loc
        self.query_lens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
        self.seq_lens = [c + q for c, q in zip(self.context_lens, self.query_lens)]
        if self.cache is None:
            if any(self.context_lens):
                raise ValueError("a stateless forward (no cache) cannot continue cached sequences")
            lens = set(self.query_lens)
            self.uniform_len = lens.pop() if len(lens) == 1 else 0
            self.prefill_seqs = list(range(len(self.query_lens)))
            return
        verify = self.verify or [False] * len(self.query_lens)
        self.spec_seqs = [b for b, v in enumerate(verify) if v]
        self.decode_seqs = [b for b, q in enumerate(self.query_lens) if q == 1 and not verify[b]]
        self.prefill_seqs = [b for b, q in enumerate(self.query_lens) if q != 1 and not verify[b]]
        if self.spec_seqs:
            width = max(self.query_lens[b] for b in self.spec_seqs)
            offs = torch.arange(width)
            lens = torch.tensor([self.query_lens[b] for b in self.spec_seqs])
            starts = torch.tensor([qsl[b] for b in self.spec_seqs])
            self.spec_valid = offs[None, :] < lens[:, None]
            self.spec_tokens = starts[:, None] + torch.minimum(offs[None, :], lens[:, None] - 1)

    @property
    def decode(self) -> DecodeBatch:
        """The decode sequences as tensors, built on first use and then shared by every layer: only the
        Python layers read them (the fused step does not, so its steps never build them)."""
        if self._decode is None:
            seqs, qsl = self.decode_seqs, self.query_start_loc
            self._decode = DecodeBatch(
                tokens=torch.tensor([qsl[b] for b in seqs], dtype=torch.long),
                keep=torch.tensor([float(self.context_lens[b] > 0) for b in seqs]),
                slots=self.state_slots[seqs],
                seq_lens=torch.tensor([self.seq_lens[b] for b in seqs]),
                block_tables=self.block_tables[seqs],
            )
        return self._decode

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @classmethod
    def stateless(cls, lengths: list[int]) -> ForwardContext:
        """Context for complete sequences of the given lengths, laid end to end, with no cache."""
        qsl = [0]
        for n in lengths:
            qsl.append(qsl[-1] + n)
        positions = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
        return cls(positions=positions, query_start_loc=qsl, context_lens=[0] * len(lengths))

    @classmethod
    def paged(
        cls, cache: CacheTensors, query_lens: list[int], context_lens: list[int],
        block_tables: list[list[int]], state_slots: list[int], verify: list[bool] | None = None,
    ) -> ForwardContext:
        """Context for sequences that continue at context_lens[b], reading/writing the given blocks."""
        block_size = cache.block_size
        qsl, positions, slots = [0], [], []
        for q, c, table in zip(query_lens, context_lens, block_tables):
            qsl.append(qsl[-1] + q)
            for p in range(c, c + q):
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
        width = max((len(t) for t in block_tables), default=0)
        tables = torch.zeros(len(block_tables), max(width, 1), dtype=torch.long)
        for b, t in enumerate(block_tables):
            tables[b, : len(t)] = torch.tensor(t, dtype=torch.long)
        return cls(
            positions=torch.tensor(positions, dtype=torch.long), query_start_loc=qsl,
            context_lens=list(context_lens), cache=cache, block_tables=tables,
            state_slots=torch.tensor(state_slots, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long), verify=verify,
        )
