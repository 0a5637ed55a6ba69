"""How many heads and channels of each kind one tensor-parallel rank holds.

Tensor parallelism follows vLLM: attention heads nh/tp, KV heads max(1, nkv/tp) (replicated when
tp > nkv), GDN key/value heads Hk/tp, Hv/tp, MLP width I/tp, embedding and lm_head vocab-parallel
(vocabulary padded to a multiple of 64, then split), norms replicated. Sparse MoE as vLLM's FusedMoE
without expert parallelism: every rank holds every expert, each with moe_intermediate_size/tp of its
width (gate|up rows, down columns); the shared expert splits like a dense MLP; the router and the shared
expert's gate are replicated, so every rank routes alike and one all-reduce after the block sums the
ranks' partial expert outputs. Qwen3-Next's fused GDN projections (in_proj_qkvz, in_proj_ba) come grouped
by key head, so a rank reads its key heads' row groups and regroups them as the whole model does."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import torch

from deltaserve.config import ConfigError, ModelConfig

VOCAB_PADDING = 64  # vLLM's VocabParallelEmbedding pads the vocabulary to this multiple before splitting


@dataclass(slots=True)
class RankShape:
    """How many heads / channels of each kind one tensor-parallel rank holds."""

    tp: int
    attention_heads: int
    kv_heads: int
    gdn_key_heads: int
    gdn_value_heads: int
    intermediate: int
    vocab: int  # padded vocabulary rows per rank
    expert_intermediate: int = 0  # each routed expert's width on one rank
    shared_expert_intermediate: int = 0


def rank_shape(cfg: ModelConfig, tp: int = 1) -> RankShape:
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")

    def split(name: str, value: int) -> int:
        if value % tp:
            raise ConfigError(f"{name} ({value}) is not divisible by tensor parallel size {tp}")
        return value // tp

    nkv = cfg.num_key_value_heads
    if tp >= nkv:
        if tp % nkv:
            raise ConfigError(f"tensor parallel size {tp} must be a multiple of num_key_value_heads ({nkv})")
        kv_heads = 1  # replicated: each of the nkv heads lives on tp/nkv ranks
    else:
        kv_heads = split("num_key_value_heads", nkv)
    padded_vocab = _round_up(cfg.vocab_size, VOCAB_PADDING)
    return RankShape(
        tp=tp,
        attention_heads=split("num_attention_heads", cfg.num_attention_heads),
        kv_heads=kv_heads,
        gdn_key_heads=split("linear_num_key_heads", cfg.linear_num_key_heads),
        gdn_value_heads=split("linear_num_value_heads", cfg.linear_num_value_heads),
        intermediate=split("intermediate_size", cfg.intermediate_size),
        vocab=math.ceil(padded_vocab / tp),
        expert_intermediate=split("moe_intermediate_size", cfg.moe_intermediate_size),
        shared_expert_intermediate=split("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size),
    )


def rank_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config of one rank's layers: its share of each kind of head and of the MLP and expert widths. The cache
    sized and allocated from it (cache/sizing.py, cache/tensors.py) is exactly what the rank holds."""
    if tp == 1:
        return cfg
    r = rank_shape(cfg, tp)
    return dataclasses.replace(
        cfg, num_attention_heads=r.attention_heads, num_key_value_heads=r.kv_heads,
        linear_num_key_heads=r.gdn_key_heads, linear_num_value_heads=r.gdn_value_heads,
        intermediate_size=r.intermediate, moe_intermediate_size=r.expert_intermediate,
        shared_expert_intermediate_size=r.shared_expert_intermediate,
    )


# Which part of a checkpoint tensor a rank keeps, by the parameter's name within its layer.
_HEAD_ROWS = re.compile(r"\.self_attn\.q_proj\.weight$")
_KV_ROWS = re.compile(r"\.self_attn\.[kv]_proj\.weight$")
_ATTN_COLS = re.compile(r"\.self_attn\.o_proj\.weight$")
_QKV_ROWS = re.compile(r"\.linear_attn\.(in_proj_qkv|conv1d)\.weight$")
_VALUE_ROWS = re.compile(r"\.linear_attn\.(in_proj_z|in_proj_b|in_proj_a)\.weight$|\.linear_attn\.(A_log|dt_bias)$")
_VALUE_COLS = re.compile(r"\.linear_attn\.out_proj\.weight$")
_MLP_ROWS = re.compile(r"\.mlp\.(gate_proj|up_proj)\.weight$")
_MLP_COLS = re.compile(r"\.mlp\.down_proj\.weight$")
_VOCAB_ROWS = re.compile(r"(^|\.)embed_tokens\.weight$|^lm_head\.weight$")
_SHARED_ROWS = re.compile(r"\.mlp\.shared_expert\.(gate_proj|up_proj)\.weight$")
_SHARED_COLS = re.compile(r"\.mlp\.shared_expert\.down_proj\.weight$")
_EXPERTS_GATE_UP = re.compile(r"\.mlp\.experts\.gate_up_proj$")  # [E, 2I, H]: per expert its gate rows, then up
_EXPERTS_DOWN = re.compile(r"\.mlp\.experts\.down_proj$")  # [E, H, I]
_EXPERT_ROWS = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj)\.weight$")  # one expert's [I, H]
_EXPERT_COLS = re.compile(r"\.mlp\.experts\.\d+\.down_proj\.weight$")  # one expert's [H, I]
# A SwiGLU's width, split: its gate/up rows (column-parallel) and down columns (row-parallel), as
# (pattern, the axis split, the RankShape field with the rank's width).
_WIDTH_SPLITS = (
    (_MLP_ROWS, 0, "intermediate"), (_MLP_COLS, 1, "intermediate"),
    (_SHARED_ROWS, 0, "shared_expert_intermediate"), (_SHARED_COLS, 1, "shared_expert_intermediate"),
    (_EXPERT_ROWS, 0, "expert_intermediate"), (_EXPERT_COLS, 1, "expert_intermediate"),
    (_EXPERTS_DOWN, 2, "expert_intermediate"),
)
_QKVZ_ROWS = re.compile(r"\.linear_attn\.in_proj_qkvz\.weight$")  # Qwen3-Next: [Hk, 2 dk + 2 r dv] rows
_BA_ROWS = re.compile(r"\.linear_attn\.in_proj_ba\.weight$")  # Qwen3-Next: [Hk, 2 r] rows


@dataclass(slots=True)
class RankPart:
    """Where a rank's part of a tensor lies: index ranges along one axis, laid end to end, then zero rows
    up to pad_rows (the padded vocabulary's last rows)."""

    dim: int  # 0: rows, 1: columns, 2: the last axis of a 3-D expert tensor
    ranges: list[tuple[int, int]]
    pad_rows: int = 0

    def take(self, t) -> torch.Tensor:
        """The part, from a tensor or a safetensors slice (which then reads only these ranges)."""
        parts = [t[(slice(None),) * self.dim + (slice(a, b),)] for a, b in self.ranges if b > a]
        missing = self.pad_rows - sum(p.shape[0] for p in parts)
        if missing > 0:  # padded vocabulary rows past the real ones: never a token's
            cols = list(t.get_shape() if hasattr(t, "get_shape") else t.shape)[1:]
            parts.append(torch.zeros(missing, *cols, dtype=parts[0].dtype if parts else torch.float32))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def rank_part(name: str, cfg: ModelConfig, rank: int, tp: int) -> RankPart | None:
    """The part of checkpoint tensor `name` (our parameter name) that rank `rank` of `tp` holds, None for
    all of it: whole query heads (each a [query hd | gate hd] row block) and their o_proj columns; KV heads
    split, or the one KV head its query heads read when tp > num_key_value_heads (replicated, as vLLM); GDN
    key heads with the value heads of their groups (in_proj_qkv rows and conv1d channels are [q: Hk*dk |
    k: Hk*dk | v: Hv*dv], each part sliced), their z/b/a rows, A_log, dt_bias and out_proj columns; MLP
    gate/up rows and down_proj columns, and so for the shared expert and each routed expert (fused 3-D or
    per expert: its gate and up rows, its down columns); embedding / lm_head rows of the padded vocabulary
    (zeros past its end); Qwen3-Next's in_proj_qkvz / in_proj_ba row groups of the rank's key heads. Norms,
    mtp.fc, the router (mlp.gate) and mlp.shared_expert_gate are replicated; the vision tower (visual.*) is
    read whole, by rank 0 alone."""
    if tp == 1 or name.startswith("visual."):
        return None
    r = rank_shape(cfg, tp)

    def block(n: int, index: int, width: int = 1, offset: int = 0) -> tuple[int, int]:
        """Block `index` of n heads, each `width` rows (or columns) wide, from `offset`."""
        return offset + index * n * width, offset + (index + 1) * n * width

    if _HEAD_ROWS.search(name):
        return RankPart(0, [block(r.attention_heads, rank, 2 * cfg.head_dim)])
    if _KV_ROWS.search(name):
        kv_rank = rank if tp <= cfg.num_key_value_heads else rank // (tp // cfg.num_key_value_heads)
        return RankPart(0, [block(r.kv_heads, kv_rank, cfg.head_dim)])
    if _ATTN_COLS.search(name):
        return RankPart(1, [block(r.attention_heads, rank, cfg.head_dim)])
    if _QKV_ROWS.search(name):
        kd, dk, dv = cfg.linear_key_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        return RankPart(0, [block(r.gdn_key_heads, rank, dk), block(r.gdn_key_heads, rank, dk, kd),
                            block(r.gdn_value_heads, rank, dv, 2 * kd)])
    if _VALUE_ROWS.search(name):
        return RankPart(0, [block(r.gdn_value_heads, rank, cfg.linear_value_head_dim if "in_proj_z" in name else 1)])
    if _VALUE_COLS.search(name):
        return RankPart(1, [block(r.gdn_value_heads, rank, cfg.linear_value_head_dim)])
    for pattern, dim, width in _WIDTH_SPLITS:
        if pattern.search(name):
            return RankPart(dim, [block(getattr(r, width), rank)])
    if _EXPERTS_GATE_UP.search(name):
        inter = r.expert_intermediate
        return RankPart(1, [block(inter, rank), block(inter, rank, offset=cfg.moe_intermediate_size)])
    if _QKVZ_ROWS.search(name) or _BA_ROWS.search(name):
        per_group = cfg.linear_num_value_heads // cfg.linear_num_key_heads  # value heads per key head
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        width = 2 * dk + 2 * per_group * dv if _QKVZ_ROWS.search(name) else 2 * per_group
        return RankPart(0, [block(r.gdn_key_heads, rank, width)])
    if _VOCAB_ROWS.search(name):
        start, end = block(r.vocab, rank)
        return RankPart(0, [(min(start, cfg.vocab_size), min(end, cfg.vocab_size))], pad_rows=r.vocab)
    return None


def rank_slice(name: str, tensor: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    """rank_part of an in-memory tensor (one dequantized from fp8, say)."""
    part = rank_part(name, cfg, rank, tp)
    return tensor if part is None else part.take(tensor)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
