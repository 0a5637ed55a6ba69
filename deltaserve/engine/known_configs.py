"""Configs of released models, in the official config.json layout, for planning and inspecting shapes that
cannot run here. Numbers as in REFERENCE.md (Qwen3.5-0.8B, Qwen3.5-27B, Qwen3.5-35B-A3B)."""

from __future__ import annotations

import copy
from typing import Any

_LAYER_TYPES_27B = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16

QWEN3_5_27B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "layer_types": list(_LAYER_TYPES_27B),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 24,
        "num_hidden_layers": 64,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "vocab_size": 248320,
    },
    "vision_config": {
        "model_type": "qwen3_5",
        "deepstack_visual_indexes": [],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "intermediate_size": 4304,
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 5120,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}

# The FP8 release: E4M3 weights with one fp32 scale per 128x128 block. The modules listed stay in bf16
# (matched as name suffixes/substrings by the planner); the list is the planner's assumption, a real
# checkpoint's own config.json wins when planning from it.
QWEN3_5_27B_FP8_CONFIG: dict[str, Any] = copy.deepcopy(QWEN3_5_27B_CONFIG)
QWEN3_5_27B_FP8_CONFIG["quantization_config"] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "embed_tokens", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
                               "model.visual", "mtp.fc"],
}

# Qwen3.5-35B-A3B: the shape REFERENCE.md gives (hidden 2048, 40 layers, 256 experts top-8 of width 512 plus
# a shared expert of 512, 16 / 2 attention heads, 32 GDN value heads, untied) with the family's common
# values (GDN 16 key heads of 128, head_dim 256, vocab 248320, [lin, lin, lin, full] x 10, rope 1e7 with
# mrope [11, 11, 10], one MTP layer). Assumed, not from a released file: the 27B's vision tower (depth 27,
# hidden 1152, transformers' Qwen3_5MoeVisionConfig defaults) projecting to 2048, eos 248044 and
# max_position_embeddings 262144 as the 27B.
QWEN3_5_35B_A3B_CONFIG: dict[str, Any] = copy.deepcopy(QWEN3_5_27B_CONFIG)
QWEN3_5_35B_A3B_CONFIG.update(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe")
_text = QWEN3_5_35B_A3B_CONFIG["text_config"]
del _text["intermediate_size"]
_text.update(
    model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10,
    num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
)
QWEN3_5_35B_A3B_CONFIG["vision_config"].update(model_type="qwen3_5_moe_vision", out_hidden_size=2048)

# Its FP8 release, assumed quantized like the 27B's (128 x 128 blocks, every expert on its own), the MoE
# router and the shared expert's gate kept in bf16 with the other small projections.
QWEN3_5_35B_A3B_FP8_CONFIG: dict[str, Any] = copy.deepcopy(QWEN3_5_35B_A3B_CONFIG)
QWEN3_5_35B_A3B_FP8_CONFIG["quantization_config"] = copy.deepcopy(QWEN3_5_27B_FP8_CONFIG["quantization_config"])
QWEN3_5_35B_A3B_FP8_CONFIG["quantization_config"]["modules_to_not_convert"] += ["mlp.gate", "mlp.shared_expert_gate"]

# Qwen3.5-0.8B: REFERENCE.md's shape (hidden 1024, 24 layers, MLP 3584, 8 / 2 attention heads, 16 GDN value
# heads, tied) with the family's common values; its vision tower depth 12, hidden 768 (heads 12 and MLP 3072
# assumed, projecting to 1024). The benchmarks build random checkpoints from it (bench_formats.py).
QWEN3_5_0_8B_CONFIG: dict[str, Any] = copy.deepcopy(QWEN3_5_27B_CONFIG)
QWEN3_5_0_8B_CONFIG["tie_word_embeddings"] = True
QWEN3_5_0_8B_CONFIG["text_config"].update(
    hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
    linear_num_value_heads=16, tie_word_embeddings=True,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
)
QWEN3_5_0_8B_CONFIG["vision_config"].update(depth=12, hidden_size=768, num_heads=12, intermediate_size=3072,
                                            out_hidden_size=1024)

KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3.5-0.8b": QWEN3_5_0_8B_CONFIG,
    "qwen3.5-27b": QWEN3_5_27B_CONFIG,
    "qwen3.5-27b-fp8": QWEN3_5_27B_FP8_CONFIG,
    "qwen3.5-35b-a3b": QWEN3_5_35B_A3B_CONFIG,
    "qwen3.5-35b-a3b-fp8": QWEN3_5_35B_A3B_FP8_CONFIG,
}


def known_config(name: str) -> dict[str, Any] | None:
    """A deep copy of the named config (case-insensitive), or None."""
    cfg = KNOWN_CONFIGS.get(name.lower())
    return copy.deepcopy(cfg) if cfg is not None else None
