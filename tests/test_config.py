"""config.json parsing: both model types, layer-type dispatch, and errors that name the problem."""

from __future__ import annotations

import pytest

from deltaserve.config import ConfigError, ModelConfig
from deltaserve.model.decoder import Qwen3_5ForCausalLM

TEXT = dict(
    model_type="qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=4,
    rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5},
)


def test_text_and_wrapper_configs_parse_alike():
    text = ModelConfig.from_dict(TEXT)
    wrapped = ModelConfig.from_dict(
        {"model_type": "qwen3_5", "text_config": {**TEXT, "model_type": "qwen3_5_text"},
         "vision_config": {"depth": 2, "hidden_size": 16, "num_heads": 2}, "tie_word_embeddings": True}
    )
    assert text.layer_types == wrapped.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert wrapped.tie_word_embeddings and wrapped.vision is not None and wrapped.vision.depth == 2
    assert text.rotary_dim == 4 and text.conv_dim == 2 * 16 + 16


def test_full_attention_interval_decides_layers_when_layer_types_missing():
    cfg = ModelConfig.from_dict({**TEXT, "num_hidden_layers": 6, "full_attention_interval": 3})
    assert cfg.attention_layer_ids == [2, 5] and cfg.gdn_layer_ids == [0, 1, 3, 4]


def test_explicit_layer_types_are_followed():
    types = ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    cfg = ModelConfig.from_dict({**TEXT, "layer_types": types})
    model = Qwen3_5ForCausalLM(cfg)
    assert [layer.layer_type for layer in model.model.layers] == types
    assert hasattr(model.model.layers[0], "self_attn") and hasattr(model.model.layers[1], "linear_attn")


def test_unknown_layer_type_names_value_layer_and_accepted():
    types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(ConfigError, match=r"layer_types\[1\].*'sliding_attention'.*layer 1.*linear_attention"):
        ModelConfig.from_dict({**TEXT, "layer_types": types})


def test_unknown_model_type_names_value_and_accepted():
    with pytest.raises(ConfigError, match=r"'llama'.*accepted: qwen3_5"):
        ModelConfig.from_dict({**TEXT, "model_type": "llama"})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
        ({"hidden_size": 0}, "'hidden_size' must be a positive integer"),
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_invalid_values_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**TEXT, **change})


def test_missing_field_is_named():
    bad = dict(TEXT)
    del bad["linear_num_key_heads"]
    with pytest.raises(ConfigError, match="'linear_num_key_heads' is missing"):
        ModelConfig.from_dict(bad)


def test_moe_config_builds_sparse_layers():
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=12)
    cfg = ModelConfig.from_dict(
        {"model_type": "qwen3_5_moe", "text_config": {**TEXT, "model_type": "qwen3_5_moe_text", **moe}}
    )
    assert cfg.is_moe and cfg.num_experts == 8 and cfg.architecture.name == "Qwen3_5MoeForConditionalGeneration"
    mlp = Qwen3_5ForCausalLM(cfg).model.layers[0].mlp
    assert mlp.experts.gate_up_proj.shape == (8, 32, 32) and mlp.shared_expert.up_proj.weight.shape == (12, 32)


def test_bad_json_file_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_file(tmp_path / "nowhere")
