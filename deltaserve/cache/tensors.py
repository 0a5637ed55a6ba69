"""Allocation of the cache storage the model reads: paged K/V for attention layers (and the MTP layer),
state slots for GDN layers."""

from __future__ import annotations

import torch

from deltaserve.config import ModelConfig
from deltaserve.model.context import CacheTensors
from deltaserve.ops.attention import kv_cache_shapes


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
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    kv = {
        i: (torch.zeros(k_shape, dtype=dtype), torch.zeros(v_shape, dtype=dtype))
        for i in attention_cache_layer_ids(cfg, with_mtp)
    }
    conv_shape = (num_slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
    ssm_shape = (num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    conv = {i: torch.zeros(conv_shape, dtype=dtype) for i in cfg.gdn_layer_ids}
    ssm = {i: torch.zeros(ssm_shape, dtype=ssm_dtype) for i in cfg.gdn_layer_ids}
    return CacheTensors(kv=kv, conv=conv, ssm=ssm)
