"""The memory planner as data for the inspector's form: the loaded model beside the real 27B configs (bf16
and FP8), all through deltaserve.engine.planner so the page and `deltaserve plan` cannot disagree."""

from __future__ import annotations

from typing import Any

import torch

from deltaserve.cli_plan import format_plan
from deltaserve.config import ModelConfig
from deltaserve.engine.known_configs import QWEN3_5_27B_CONFIG, QWEN3_5_27B_FP8_CONFIG
from deltaserve.engine.planner import plan_memory
from deltaserve.inspect.trace import CONFIG, MEASURED


def _plan_dict(
    cfg: ModelConfig, name: str, dtype: str | None, weight_dtype: str | None = None, **kw: Any
) -> dict[str, Any]:
    try:
        p = plan_memory(cfg, dtype=dtype, weight_dtype=weight_dtype, model_name=name, include_vision=False,
                        **kw)
    except (ValueError, NotImplementedError) as e:
        return {"name": name, "error": str(e)}
    return {
        "name": name, "source": CONFIG,
        "layers": p.num_layers, "gdn_layers": p.num_gdn_layers, "attention_layers": p.num_attention_layers,
        "model_dtype": p.model_dtype, "weight_dtype": p.weight_dtype, "kv_cache_dtype": p.kv_cache_dtype,
        "ssm_state_dtype": p.ssm_state_dtype,
        "weight_bytes": p.weight_bytes, "text_params": p.text_params,
        "kv_bytes_per_token_per_layer": p.kv_bytes_per_token_per_layer,
        "kv_bytes_per_token": p.kv_bytes_per_token, "kv_cache_bytes": p.kv_cache_bytes,
        "num_kv_blocks": p.num_kv_blocks, "blocks_per_seq": p.blocks_per_seq,
        "gdn_recurrent_bytes_per_layer": p.gdn_recurrent_bytes_per_layer,
        "gdn_conv_bytes_per_layer": p.gdn_conv_bytes_per_layer,
        "gdn_state_bytes_per_seq": p.gdn_state_bytes_per_seq, "gdn_state_bytes": p.gdn_state_bytes,
        "total_bytes": p.total_bytes,
        "rank": {"attention_heads": p.rank.attention_heads, "kv_heads": p.rank.kv_heads,
                 "gdn_value_heads": p.rank.gdn_value_heads, "intermediate": p.rank.intermediate},
        "text": format_plan(p),
    }


def memory_plans(
    model_cfg: ModelConfig, model_dtype: torch.dtype, max_model_len: int, max_num_seqs: int,
    kv_cache_dtype: str = "auto", tp: int = 1, allocated: dict[str, Any] | None = None,
) -> dict[str, Any]:
    kw = dict(max_model_len=max_model_len, max_num_seqs=max_num_seqs, kv_cache_dtype=kv_cache_dtype, tp=tp)
    # The loaded weights are in the dtype the engine cast them to, not the config's.
    dtype = str(model_dtype).removeprefix("torch.")
    loaded = _plan_dict(model_cfg, "loaded model", dtype, weight_dtype=dtype, **kw)
    if allocated is not None:
        loaded["allocated"] = {**allocated, "source": MEASURED}
    return {
        "inputs": kw,
        "plans": [
            loaded,
            _plan_dict(ModelConfig.from_dict(QWEN3_5_27B_CONFIG), "Qwen3.5-27B (bf16)", "bfloat16", **kw),
            _plan_dict(ModelConfig.from_dict(QWEN3_5_27B_FP8_CONFIG), "Qwen3.5-27B-FP8", "bfloat16", **kw),
        ],
    }


def allocated_cache(engine: Any) -> dict[str, Any] | None:
    """What this engine really allocated (bytes of its cache tensors), or None without an engine."""
    if engine is None:
        return None
    ct = engine.cache_tensors
    kv_pairs = [*ct.kv.values(), *ct.kv_scales.values()]  # an fp8 cache's row scales count as KV bytes
    kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv_pairs)
    gdn = sum(t.numel() * t.element_size() for t in [*ct.conv.values(), *ct.ssm.values()])
    usage = engine.cache.usage()
    return {"kv_bytes": kv, "gdn_state_bytes": gdn, "num_blocks": usage.total_blocks,
            "num_slots": usage.total_slots, "block_size": engine.cache.block_size,
            "max_model_len": engine.max_model_len}
