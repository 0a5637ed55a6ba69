"""Cache sizing: the bytes of a KV block and of a GDN state slot, and how many of each a budget holds.
The engine sizes its pools here (plan_cache) and the planner counts with the same functions."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deltaserve.cache.dtypes import dtype_bytes
from deltaserve.config import ConfigError, ModelConfig
from deltaserve.model.sharding import rank_shape

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_MEMORY = 256 * 1024**2  # bytes of KV blocks + GDN state slots unless told

def num_kv_cache_layers(cfg: ModelConfig, with_mtp: bool = False) -> int:
    """Attention layers with a paged KV cache; the MTP layer(s) add their own when speculating (the same
    count `deltaserve.cache.tensors.allocate_cache` allocates)."""
    n = len(cfg.attention_layer_ids)
    if with_mtp:
        n += max(cfg.mtp_num_hidden_layers, 1)
    return n


def kv_bytes_per_token_per_layer(cfg: ModelConfig, dtype: str | torch.dtype, tp: int = 1) -> int:
    """K and V of one token in one attention layer: 2 * nkv * hd * bytes (per rank)."""
    return 2 * rank_shape(cfg, tp).kv_heads * cfg.head_dim * dtype_bytes(dtype)


def kv_bytes_per_block(
    cfg: ModelConfig, block_size: int, dtype: str | torch.dtype, with_mtp: bool = False, tp: int = 1
) -> int:
    """One block id's storage: block_size tokens across every KV-cached layer (blocks are allocated for all
    attention layers at once)."""
    return block_size * kv_bytes_per_token_per_layer(cfg, dtype, tp) * num_kv_cache_layers(cfg, with_mtp)


def gdn_recurrent_bytes_per_layer(
    cfg: ModelConfig, ssm_dtype: str | torch.dtype | None = None, tp: int = 1
) -> int:
    """Recurrent state S [Hv, dk, dv] of one sequence in one GDN layer (fp32 by mamba_ssm_dtype)."""
    ssm = ssm_dtype if ssm_dtype is not None else cfg.mamba_ssm_dtype
    hv = rank_shape(cfg, tp).gdn_value_heads
    return hv * cfg.linear_key_head_dim * cfg.linear_value_head_dim * dtype_bytes(ssm)


def gdn_conv_dim(cfg: ModelConfig, tp: int = 1) -> int:
    r = rank_shape(cfg, tp)
    return 2 * r.gdn_key_heads * cfg.linear_key_head_dim + r.gdn_value_heads * cfg.linear_value_head_dim


def gdn_conv_bytes_per_layer(cfg: ModelConfig, dtype: str | torch.dtype, tp: int = 1) -> int:
    """Conv state [conv_dim, K-1] of one sequence in one GDN layer, in the model dtype."""
    return gdn_conv_dim(cfg, tp) * (cfg.linear_conv_kernel_dim - 1) * dtype_bytes(dtype)


def gdn_state_bytes_per_seq(
    cfg: ModelConfig, dtype: str | torch.dtype, ssm_dtype: str | torch.dtype | None = None, tp: int = 1
) -> int:
    """All GDN layers' state for one sequence (one state slot): layers * (recurrent + conv). `dtype` is the
    conv state's (model) dtype; the recurrent state uses `ssm_dtype`, default cfg.mamba_ssm_dtype."""
    per_layer = gdn_recurrent_bytes_per_layer(cfg, ssm_dtype, tp) + gdn_conv_bytes_per_layer(cfg, dtype, tp)
    return len(cfg.gdn_layer_ids) * per_layer


def num_blocks_for(
    memory_bytes: int, cfg: ModelConfig, block_size: int, dtype: str | torch.dtype,
    with_mtp: bool = False, tp: int = 1,
) -> int:
    """How many KV blocks fit in memory_bytes (0 if none)."""
    per_block = kv_bytes_per_block(cfg, block_size, dtype, with_mtp, tp)
    if per_block == 0:
        raise ConfigError("this model has no attention layers, so it has no KV blocks to size")
    return max(0, int(memory_bytes) // per_block)


def num_slots_for(
    memory_bytes: int, cfg: ModelConfig, dtype: str | torch.dtype,
    ssm_dtype: str | torch.dtype | None = None, tp: int = 1,
) -> int:
    """How many GDN state slots (concurrent sequences) fit in memory_bytes."""
    per_seq = gdn_state_bytes_per_seq(cfg, dtype, ssm_dtype, tp)
    return max(0, int(memory_bytes) // per_seq) if per_seq else 0


# ---- the engine's pools ---------------------------------------------------------------------------------
@dataclass(slots=True)
class CachePlan:
    num_blocks: int
    num_slots: int
    max_model_len: int


class CacheSizeError(ValueError):
    """The cache options cannot hold what they must; the message names the options and what would fit."""


def plan_cache(
    cfg: ModelConfig, kv_dtype: torch.dtype, *, block_size: int, max_num_seqs: int, max_model_len: int | None,
    kv_cache_memory: int | None, num_kv_blocks: int | None, with_mtp: bool = False,
) -> CachePlan:
    """Split kv_cache_memory between max_num_seqs GDN state slots and as many KV blocks as fit, no more
    than max_num_seqs sequences of max_model_len could use (num_kv_blocks forces the block count). Raise if
    one max_model_len sequence does not fit, since then a lone request could never complete."""
    bs = block_size
    slots = max_num_seqs
    block_bytes = kv_bytes_per_block(cfg, bs, kv_dtype, with_mtp)
    slot_bytes = gdn_state_bytes_per_seq(
        cfg, kv_dtype, ssm_dtype=torch.float32
    )  # allocate_cache keeps it fp32
    memory = kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
    if num_kv_blocks is not None:
        available = num_kv_blocks
    else:
        if slots * slot_bytes > memory:
            raise CacheSizeError(
                f"kv_cache_memory={memory} bytes cannot hold the GDN states of max_num_seqs={slots} "
                f"sequences ({slots * slot_bytes} bytes); raise kv_cache_memory or lower max_num_seqs"
            )
        available = (memory - slots * slot_bytes) // max(block_bytes, 1)
    max_len = max_model_len
    if max_len is None:
        # The model's own limit, shortened (with a warning) to what one sequence can hold in this cache.
        max_len = min(cfg.max_position_embeddings, available * bs)
        if max_len < cfg.max_position_embeddings:
            log.warning(
                "max_model_len set to %d (the cache holds no more); the model allows %d",
                max_len,
                cfg.max_position_embeddings,
            )
    elif max_len > cfg.max_position_embeddings:
        raise CacheSizeError(
            f"max_model_len={max_len} exceeds the model's max_position_embeddings "
            f"({cfg.max_position_embeddings})"
        )
    per_seq = -(-max_len // bs)
    if available < per_seq or max_len <= 0:
        raise CacheSizeError(
            f"the KV cache has {available} blocks of {bs} tokens but one sequence of max_model_len={max_len} "
            f"needs {per_seq}; raise kv_cache_memory / num_kv_blocks or lower max_model_len"
        )
    blocks = available if num_kv_blocks is not None else min(available, slots * per_seq)
    return CachePlan(num_blocks=blocks, num_slots=slots, max_model_len=max_len)
