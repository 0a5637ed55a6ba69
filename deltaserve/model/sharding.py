"""How many heads and channels of each kind one tensor-parallel rank holds.

Tensor parallelism follows vLLM: attention heads nh/tp, KV heads max(1, nkv/tp) (replicated when
tp > nkv), GDN key/value heads Hk/tp, Hv/tp, MLP width I/tp, embedding and lm_head vocab-parallel
(vocabulary padded to a multiple of 64, then split), norms replicated."""

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
    )


def rank_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config of one rank's layers: its share of each kind of head and of the MLP width. The cache
    sized and allocated from it (cache/sizing.py, cache/tensors.py) is exactly what the rank holds."""
    if tp == 1:
        return cfg
    r = rank_shape(cfg, tp)
    return dataclasses.replace(
        cfg, num_attention_heads=r.attention_heads, num_key_value_heads=r.kv_heads,
        linear_num_key_heads=r.gdn_key_heads, linear_num_value_heads=r.gdn_value_heads,
        intermediate_size=r.intermediate,
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


def rank_slice(name: str, tensor: torch.Tensor, cfg: ModelConfig, rank: int, tp: int) -> torch.Tensor:
    """The part of checkpoint tensor `name` (our parameter name) that rank `rank` of `tp` holds: whole
    query heads (each a [query hd | gate hd] row block) and their o_proj columns; KV heads split, or the one
    KV head its query heads read when tp > num_key_value_heads (replicated, as vLLM); GDN key heads with
    the value heads of their groups (in_proj_qkv rows and conv1d channels are [q: Hk*dk | k: Hk*dk |
    v: Hv*dv], each part sliced), their z/b/a rows, A_log, dt_bias and out_proj columns; MLP gate/up rows and
    down_proj columns; embedding / lm_head rows of the padded vocabulary (zeros past its end). Norms and
    mtp.fc are replicated (the whole tensor)."""
    if tp == 1:
        return tensor
    r = rank_shape(cfg, tp)

    def rows(t: torch.Tensor, n: int, index: int, width: int = 1) -> torch.Tensor:
        """Block `index` of n-row blocks, each `width` rows wide (heads of `width` rows)."""
        return t[index * n * width : (index + 1) * n * width]

    if _HEAD_ROWS.search(name):
        return rows(tensor, r.attention_heads, rank, 2 * cfg.head_dim)
    if _KV_ROWS.search(name):
        kv_rank = rank if tp <= cfg.num_key_value_heads else rank // (tp // cfg.num_key_value_heads)
        return rows(tensor, r.kv_heads, kv_rank, cfg.head_dim)
    if _ATTN_COLS.search(name):
        return rows(tensor.t(), r.attention_heads, rank, cfg.head_dim).t()
    if _QKV_ROWS.search(name):
        kd, vd = cfg.linear_key_dim, cfg.linear_value_dim
        q, k, v = tensor[:kd], tensor[kd : 2 * kd], tensor[2 * kd : 2 * kd + vd]
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        return torch.cat([rows(q, r.gdn_key_heads, rank, dk), rows(k, r.gdn_key_heads, rank, dk),
                          rows(v, r.gdn_value_heads, rank, dv)])
    if _VALUE_ROWS.search(name):
        width = cfg.linear_value_head_dim if "in_proj_z" in name else 1
        return rows(tensor, r.gdn_value_heads, rank, width)
    if _VALUE_COLS.search(name):
        return rows(tensor.t(), r.gdn_value_heads, rank, cfg.linear_value_head_dim).t()
    if _MLP_ROWS.search(name):
        return rows(tensor, r.intermediate, rank)
    if _MLP_COLS.search(name):
        return rows(tensor.t(), r.intermediate, rank).t()
    if _VOCAB_ROWS.search(name):
        part = rows(tensor, r.vocab, rank)
        if part.shape[0] < r.vocab:  # the padding rows of the last rank(s): never a real token's
            part = torch.cat([part, part.new_zeros(r.vocab - part.shape[0], *part.shape[1:])])
        return part
    return tensor


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
