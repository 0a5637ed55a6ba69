"""Allocation of the cache storage the model reads: paged K/V for attention layers (and the MTP layer),
with their row scales when fp8, and state slots for GDN layers."""

from __future__ import annotations

import torch

from deltaserve.cache.dtypes import engine_kv_cache_dtype
from deltaserve.cache.sizing import conv_state_dtype
from deltaserve.config import ModelConfig
from deltaserve.model.context import CacheTensors
from deltaserve.ops.attention import FP8, kv_cache_shapes, kv_scale_shapes

# The engine's kv_cache_dtype names (cache/dtypes.py ENGINE_KV_CACHE_DTYPES) as torch dtypes.
KV_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": FP8, "fp8_e4m3": FP8}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for an engine kv_cache_dtype option ('auto': the model's)."""
    name = engine_kv_cache_dtype(kv_cache_dtype)
    return model_dtype if name == "auto" else KV_TORCH_DTYPES[name]


def attention_cache_layer_ids(cfg: ModelConfig, with_mtp: bool) -> list[int]:
    ids = list(cfg.attention_layer_ids)
    if with_mtp:
        ids += [cfg.num_hidden_layers + i for i in range(max(cfg.mtp_num_hidden_layers, 1))]
    return ids


def allocate_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int,
    dtype: torch.dtype = torch.float32, with_mtp: bool = False,
    ssm_dtype: torch.dtype = torch.float32,
) -> CacheTensors:
    """dtype: the K/V blocks' (torch.float8_e4m3fn adds their fp32 row scales, kv_scales) and, but for fp8,
    the GDN conv state's (sizing.conv_state_dtype)."""
    nkv = cfg.num_key_value_heads
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, nkv, cfg.head_dim)
    layer_ids = attention_cache_layer_ids(cfg, with_mtp)
    kv = {i: (torch.zeros(k_shape, dtype=dtype), torch.zeros(v_shape, dtype=dtype)) for i in layer_ids}
    kv_scales = {}
    if dtype == FP8:
        ks_shape, vs_shape = kv_scale_shapes(num_blocks, block_size, nkv)
        kv_scales = {i: (torch.zeros(ks_shape), torch.zeros(vs_shape)) for i in layer_ids}
    conv_shape = (num_slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
    ssm_shape = (num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    conv = {i: torch.zeros(conv_shape, dtype=conv_state_dtype(dtype)) for i in cfg.gdn_layer_ids}
    ssm = {i: torch.zeros(ssm_shape, dtype=ssm_dtype) for i in cfg.gdn_layer_ids}
    return CacheTensors(kv=kv, conv=conv, ssm=ssm, kv_scales=kv_scales)
