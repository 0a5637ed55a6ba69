"""How many heads and channels of each kind one tensor-parallel rank holds.

Tensor parallelism follows vLLM: attention heads nh/tp, KV heads max(1, nkv/tp) (replicated when
tp > nkv), GDN key/value heads Hk/tp, Hv/tp, MLP width I/tp, embedding and lm_head vocab-parallel
(vocabulary padded to a multiple of 64, then split), norms replicated. Sparse MoE as vLLM's FusedMoE
without expert parallelism: every rank holds every expert, each with moe_intermediate_size/tp of its
width (gate|up rows, down columns); the shared expert splits like a dense MLP; the router and the shared
expert's gate are replicated."""

from __future__ import annotations

import math
from dataclasses import dataclass

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




def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m
