"""Cache sizing: the bytes of a KV block and of a GDN state slot, and how many of each a budget holds.
The engine sizes its pools here (plan_cache) and the planner counts with the same functions."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from deltaserve.cache.dtypes import dtype_bytes, kv_scale_bytes
from deltaserve.config import ConfigError, ModelConfig
from deltaserve.model.sharding import rank_shape

log = logging.getLogger(__name__)

MIN_KV_CACHE_MEMORY = 256 * 1024**2  # the default budget never goes below this
DEFAULT_CACHE_MEMORY_FRACTION = 0.5  # of the memory available once the weights are in


def available_memory_bytes() -> int:
    """The memory the machine can give now without swapping (MemAvailable), 0 where it cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def default_cache_memory(fraction: float = DEFAULT_CACHE_MEMORY_FRACTION) -> int:
    """The cache budget when kv_cache_memory is not given: a fraction of the memory available after the
    weights loaded, as vLLM's memory utilisation sizes its pool from what is left (the pools then take
    only what max_num_seqs sequences of max_model_len can use)."""
    return max(MIN_KV_CACHE_MEMORY, int(fraction * available_memory_bytes()))


def num_kv_cache_layers(cfg: ModelConfig, with_mtp: bool = False) -> int:
    """Attention layers with a paged KV cache; the MTP layer(s) add their own when speculating (the same
    count `deltaserve.cache.tensors.allocate_cache` allocates)."""
    n = len(cfg.attention_layer_ids)
    if with_mtp:
        n += max(cfg.mtp_num_hidden_layers, 1)
    return n


def kv_bytes_per_token_per_layer(cfg: ModelConfig, dtype: str | torch.dtype, tp: int = 1) -> int:
    """K and V of one token in one attention layer: 2 * nkv * hd * bytes (per rank), and an fp8 cache's
    fp32 scale of each K and V row, 2 * nkv * 4 more."""
    nkv = rank_shape(cfg, tp).kv_heads
    return 2 * nkv * cfg.head_dim * dtype_bytes(dtype) + nkv * kv_scale_bytes(dtype)


def conv_state_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The GDN conv state's dtype beside a KV cache of kv_dtype: the same, except that an fp8 KV cache keeps
    the conv state in float32 (it feeds the recurrence; a few KB per sequence)."""
    return torch.float32 if dtype_bytes(kv_dtype) == 1 else kv_dtype


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


def default_num_snapshots(max_num_seqs: int, num_gdn_snapshots: int | None = None) -> int:
    """The GDN snapshot pool of prefix caching: num_gdn_snapshots, or 4 per sequence slot. A request saves
    a snapshot at its prompt's end, at the end of a prefix it shares with an earlier one and every
    mamba_block_size tokens; the pool should keep those of the last turns of every running conversation."""
    return num_gdn_snapshots or 4 * max_num_seqs


# ---- the engine's pools ---------------------------------------------------------------------------------
@dataclass(slots=True)
class CachePlan:
    num_blocks: int
    num_slots: int
    max_model_len: int
    num_snapshots: int = 0  # GDN snapshots for prefix caching (0 without it)


class CacheSizeError(ValueError):
    """The cache options cannot hold what they must; the message names the options and what would fit."""


@dataclass(slots=True)
class CacheOptions:
    """The engine options that size its cache pools."""

    block_size: int
    max_num_seqs: int
    max_model_len: int | None
    kv_cache_memory: int | None
    num_kv_blocks: int | None  # forces the block count (tests of cache pressure)
    enable_prefix_caching: bool | None  # None: on where its snapshot pool costs no max_model_len
    num_gdn_snapshots: int | None = None
    cache_memory_fraction: float = DEFAULT_CACHE_MEMORY_FRACTION  # used when kv_cache_memory is None

    @classmethod
    def of(cls, config) -> CacheOptions:
        """The options from an object with these fields by name (the engine's EngineConfig)."""
        return cls(**{f: getattr(config, f) for f in cls.__dataclass_fields__})


def plan_cache(cfg: ModelConfig, kv_dtype: torch.dtype, opts: CacheOptions, with_mtp: bool = False) -> CachePlan:
    """Split kv_cache_memory between max_num_seqs GDN state slots, the GDN snapshot pool of prefix
    caching (one slot's size each) and as many KV blocks as fit, no more than max_num_seqs sequences of
    max_model_len could use. Raise if one max_model_len sequence does not fit, since then a lone request
    could never complete. Prefix caching left to its default is on only where its snapshot pool costs
    nothing else: the same max_model_len still fits."""
    if opts.kv_cache_memory is None:  # measured once: both plans below split the same budget
        opts = dataclasses.replace(opts, kv_cache_memory=default_cache_memory(opts.cache_memory_fraction))
    on = opts.enable_prefix_caching
    snapshots = 0 if on is False else default_num_snapshots(opts.max_num_seqs, opts.num_gdn_snapshots)
    if on is None and opts.num_kv_blocks is None:
        plain = _plan_cache(cfg, kv_dtype, opts, with_mtp, 0)
        try:
            plan = _plan_cache(cfg, kv_dtype, opts, with_mtp, snapshots)
        except CacheSizeError:
            plan = None
        if plan is None or plan.max_model_len < plain.max_model_len:
            log.warning(
                "prefix caching is off: kv_cache_memory=%d bytes cannot hold its %d GDN snapshots beside the "
                "state slots and one max_model_len sequence; raise kv_cache_memory or set num_gdn_snapshots",
                opts.kv_cache_memory, snapshots,
            )
            plan = plain
    else:
        plan = _plan_cache(cfg, kv_dtype, opts, with_mtp, snapshots)
    if opts.max_model_len is None and plan.max_model_len < cfg.max_position_embeddings:
        log.warning("max_model_len set to %d (the cache holds no more); the model allows %d",
                    plan.max_model_len, cfg.max_position_embeddings)
    return plan


def _plan_cache(
    cfg: ModelConfig, kv_dtype: torch.dtype, opts: CacheOptions, with_mtp: bool, snapshots: int
) -> CachePlan:
    bs = opts.block_size
    slots = opts.max_num_seqs
    block_bytes = kv_bytes_per_block(cfg, bs, kv_dtype, with_mtp)
    # allocate_cache's dtypes: the recurrent state fp32, the conv state conv_state_dtype
    slot_bytes = gdn_state_bytes_per_seq(cfg, conv_state_dtype(kv_dtype), ssm_dtype=torch.float32)
    memory = opts.kv_cache_memory or MIN_KV_CACHE_MEMORY
    if opts.num_kv_blocks is not None:
        available = opts.num_kv_blocks
    else:
        states = (slots + snapshots) * slot_bytes
        if states > memory:
            with_snapshots = f" and {snapshots} prefix-caching snapshots" if snapshots else ""
            raise CacheSizeError(
                f"kv_cache_memory={memory} bytes cannot hold the GDN states of max_num_seqs={slots} "
                f"sequences{with_snapshots} ({states} bytes); raise kv_cache_memory or lower max_num_seqs"
                + (" / num_gdn_snapshots" if snapshots else "")
            )
        available = (memory - states) // max(block_bytes, 1)
    max_len = opts.max_model_len
    if max_len is None:
        # The model's own limit, shortened (plan_cache warns) to what one sequence can hold in this cache.
        max_len = min(cfg.max_position_embeddings, available * bs)
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
    blocks = available if opts.num_kv_blocks is not None else min(available, slots * per_seq)
    return CachePlan(num_blocks=blocks, num_slots=slots, max_model_len=max_len, num_snapshots=snapshots)
