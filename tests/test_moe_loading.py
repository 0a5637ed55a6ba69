"""MoE configs and checkpoints: the architecture registry, the MoE config fields and their errors, both
expert layouts into the same parameters, FP8 per-expert tensors dequantized, Qwen3-Next's fused GDN
projections split, and errors naming the tensor at fault."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from deltaserve.config import ARCHITECTURES, ConfigError, ModelConfig
from deltaserve.model.decoder import Qwen3_5ForCausalLM
from deltaserve.model.loader import CheckpointError, load_model
from deltaserve.model.moe import SparseMoeBlock
from deltaserve.model.parallel import Shard
from deltaserve.model.sharding import rank_slice
from tests.checkpoints import (
    MOE,
    RATIOS_27B,
    TINY,
    quantize_fp8,
    random_hf_moe_model,
    save_causal_lm_layout,
    save_official_layout,
)
from tests.test_loader import copy_with, logits

TEXT = dict(
    model_type="qwen3_5_moe_text", vocab_size=64, hidden_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=4,
    rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}, **MOE,
)
NEXT = {**TEXT, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "intermediate_size": 40}


def test_every_registered_architecture_builds():
    configs = {
        "Qwen3_5ForCausalLM": {**TEXT, "model_type": "qwen3_5_text", "num_experts": 0, "intermediate_size": 40},
        "Qwen3_5MoeForCausalLM": TEXT,
        "Qwen3NextForCausalLM": NEXT,
    }
    configs["Qwen3_5ForConditionalGeneration"] = {"model_type": "qwen3_5", "text_config": configs["Qwen3_5ForCausalLM"]}
    configs["Qwen3_5MoeForConditionalGeneration"] = {"model_type": "qwen3_5_moe", "text_config": TEXT}
    assert set(configs) == set(ARCHITECTURES)
    for name, data in configs.items():
        cfg = ModelConfig.from_dict({**data, "architectures": [name]})
        assert cfg.architecture.name == name
        model = Qwen3_5ForCausalLM(cfg)
        sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
        assert sparse == [name.startswith(("Qwen3_5Moe", "Qwen3Next"))] * 4, name


def test_unknown_architecture_lists_the_known_ones():
    known = r"Qwen3_5ForCausalLM, .*Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM"
    with pytest.raises(ConfigError, match=r"'LlamaForCausalLM' is not supported; known architectures: " + known):
        ModelConfig.from_dict({**TEXT, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match=r"'Qwen3NextForCausalLM' expects model_type 'qwen3_next'.*'qwen3_5_moe_t"):
        ModelConfig.from_dict({**TEXT, "architectures": ["Qwen3NextForCausalLM"]})


def test_sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step():
    cfg = ModelConfig.from_dict({**NEXT, "num_hidden_layers": 6, "mlp_only_layers": [3], "decoder_sparse_step": 2})
    assert cfg.sparse_layer_ids == [1, 5] and cfg.dense_layer_ids == [0, 2, 3, 4]
    assert cfg.sparse_mlp(6)  # the MTP layer of a MoE model
    dense = ModelConfig.from_dict({**NEXT, "num_experts": 0})
    assert not dense.is_moe and dense.sparse_layer_ids == []


@pytest.mark.parametrize(
    "data, message",
    [
        ({**TEXT, "mlp_only_layers": [1]}, r"'mlp_only_layers' is \[1\], but Qwen3_5MoeForCausalLM supports only \[\]"),
        ({**TEXT, "norm_topk_prob": False}, "'norm_topk_prob' is False"),
        ({k: v for k, v in TEXT.items() if k != "num_experts_per_tok"}, "'num_experts_per_tok' is missing"),
        ({**TEXT, "num_experts": 0}, "'num_experts' must be a positive integer for Qwen3_5MoeForCausalLM"),
        ({**TEXT, "num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) is more than num_experts \(8\)"),
        ({**NEXT, "mlp_only_layers": [4]}, r"names layer\(s\) \[4\] outside 0..3"),
        ({**NEXT, "intermediate_size": 0, "mlp_only_layers": [0]}, "'intermediate_size' must be a positive"),
        ({**NEXT, "decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
    ],
)
def test_bad_moe_fields_are_named(data, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(data)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    hf = random_hf_moe_model("qwen3_5_moe", TINY, seed=3)
    return hf, save_official_layout(hf, tmp_path_factory.mktemp("moe"))  # one tensor per expert


EXPERT = "model.language_model.layers.1.mlp.experts."


def test_both_expert_layouts_fill_the_same_parameters(moe_checkpoint, tmp_path):
    hf, path = moe_checkpoint
    fused = save_official_layout(hf, tmp_path, fused_experts=True)
    assert f"{EXPERT}gate_up_proj" in load_file(str(fused / "model.safetensors"))
    a, b = load_model(path).state_dict(), load_model(fused).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["model.layers.1.mlp.experts.gate_up_proj"], hf.model.layers[1].mlp.experts.gate_up_proj)


def test_missing_expert_tensor_is_named(moe_checkpoint, tmp_path):
    _, path = moe_checkpoint
    dst = copy_with(tmp_path, path, lambda t: t.pop(f"{EXPERT}3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_model(dst)


def test_an_expert_past_num_experts_is_unexpected(moe_checkpoint, tmp_path):
    _, path = moe_checkpoint
    extra = f"{EXPERT}8.down_proj.weight"  # experts 0..7
    dst = copy_with(tmp_path, path, lambda t: t.update({extra: t[f"{EXPERT}0.down_proj.weight"].clone()}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*layers\.1\.mlp\.experts\.8\.down_proj\.weight"):
        load_model(dst)


def test_missing_experts_altogether_are_named(moe_checkpoint, tmp_path):
    _, path = moe_checkpoint
    dst = copy_with(tmp_path, path, lambda t: [t.pop(k) for k in list(t) if k.startswith(EXPERT)])
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.gate_up_proj \(or per-expert"):
        load_model(dst)


def test_misshaped_expert_tensor_is_named_with_its_place(moe_checkpoint, tmp_path):
    _, path = moe_checkpoint
    name = f"{EXPERT}5.gate_proj.weight"
    dst = copy_with(tmp_path, path, lambda t: t.update({name: t[name][:-1].clone()}))
    with pytest.raises(CheckpointError, match=r"experts\.5\.gate_proj\.weight' has shape \(19, 48\), expected "
                                              r"\(20, 48\) for model\.layers\.1\.mlp\.experts\.gate_up_proj\[5\] "
                                              r"\(gate rows\)"):
        load_model(dst)


def test_misshaped_fused_experts_are_named(moe_checkpoint, tmp_path):
    hf, _ = moe_checkpoint
    fused = save_official_layout(hf, tmp_path / "fused", fused_experts=True)
    name = f"{EXPERT}down_proj"
    dst = copy_with(tmp_path, fused, lambda t: t.update({name: t[name][:7].clone()}))
    with pytest.raises(CheckpointError, match=r"experts\.down_proj' has shape \(7, 48, 20\), expected \(8, 48, 20\)"):
        load_model(dst)


def test_both_layouts_at_once_is_an_error(moe_checkpoint, tmp_path):
    hf, path = moe_checkpoint
    extra = {f"{EXPERT}gate_up_proj": hf.model.layers[1].mlp.experts.gate_up_proj.detach().clone()}
    dst = copy_with(tmp_path, path, lambda t: t.update(extra))
    with pytest.raises(CheckpointError, match=r"gate_up_proj \(given both fused and per expert"):
        load_model(dst)


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused-3d"])
def test_fp8_expert_tensors_are_dequantized(moe_checkpoint, tmp_path, fused):
    """Per-expert FP8 tensors (the FP8 releases) with their weight_scale_inv, and fused 3-D ones with one
    block-scale grid per expert (x_scale_inv), dequantize into the same parameters."""
    hf, path = moe_checkpoint
    if fused:
        path = save_official_layout(hf, tmp_path / "fused", fused_experts=True)
    block, expected = 16, {}

    def quantize(tensors):
        for name in [n for n in tensors if ".experts." in n]:
            parts = [quantize_fp8(w, block) for w in (tensors[name] if fused else [tensors[name]])]
            q, scale, deq = (torch.stack(x) for x in zip(*parts, strict=True)) if fused else parts[0]
            tensors[name], tensors[name + "_scale_inv"], expected[name] = q, scale, deq

    dst = copy_with(tmp_path, path, quantize)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(config))
    model = load_model(dst, dtype="float32")
    experts = model.model.layers[1].mlp.experts
    inter = MOE["moe_intermediate_size"]
    if fused:
        assert torch.equal(experts.gate_up_proj, expected[f"{EXPERT}gate_up_proj"])
        assert torch.equal(experts.down_proj, expected[f"{EXPERT}down_proj"])
    else:
        assert torch.equal(experts.gate_up_proj[2, :inter], expected[f"{EXPERT}2.gate_proj.weight"])
        assert torch.equal(experts.gate_up_proj[2, inter:], expected[f"{EXPERT}2.up_proj.weight"])
        assert torch.equal(experts.down_proj[7], expected[f"{EXPERT}7.down_proj.weight"])
    assert not torch.equal(experts.down_proj, hf.model.layers[1].mlp.experts.down_proj)  # really rounded
    torch.testing.assert_close(experts.down_proj, hf.model.layers[1].mlp.experts.down_proj, atol=0.02, rtol=0.1)
    assert torch.isfinite(logits(model, torch.arange(10))).all()
    # A tensor-parallel rank reads fp8 experts whole (their scales come in blocks) and keeps its slice of
    # each once dequantized: its half of every expert's width.
    rank1 = dict(load_model(dst, dtype="float32", shard=Shard(1, 2)).named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(rank1[name], rank_slice(name, p, model.config, 1, 2)), name
    assert rank1["model.layers.1.mlp.experts.down_proj"].shape[2] == inter // 2


def test_qwen3_next_fused_gdn_projections_are_split_per_key_head_group(tmp_path):
    """in_proj_qkvz rows are [Hk groups of q, k, r value heads, r z heads]: with RATIOS_27B (r = 3, dk != dv)
    value head j = g*r + i lands at rows j*dv of in_proj_qkv's value part and of in_proj_z."""
    hf = random_hf_moe_model("qwen3_next", RATIOS_27B, seed=4)
    ours = load_model(save_causal_lm_layout(hf, tmp_path), dtype="float32")
    assert_split_like_transformers(hf.model.layers[0].linear_attn, ours.model.layers[0].linear_attn)


def assert_split_like_transformers(theirs, mine) -> None:
    """Our four GDN projections give what transformers' fix_query_key_value_ordering makes of its two."""
    x = torch.randn(5, theirs.hidden_size)
    with torch.no_grad():
        q, k, v, z, b, a = theirs.fix_query_key_value_ordering(theirs.in_proj_qkvz(x[None]), theirs.in_proj_ba(x[None]))
        pairs = [(mine.in_proj_qkv(x), torch.cat([t.reshape(5, -1) for t in (q[0], k[0], v[0])], dim=-1)),
                 (mine.in_proj_z(x), z[0].reshape(5, -1)), (mine.in_proj_b(x), b[0]), (mine.in_proj_a(x), a[0])]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_qwen3_next_misshaped_qkvz_is_named(tmp_path):
    path = save_causal_lm_layout(random_hf_moe_model("qwen3_next", TINY, seed=5), tmp_path / "next")
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    dst = copy_with(tmp_path, path, lambda t: t.update({name: t[name][:-2].clone()}))
    with pytest.raises(CheckpointError, match=r"in_proj_qkvz\.weight' has shape \(126, 48\), expected \(128, 48\) "
                                              r"from config\.json \(2 key-head groups of 8 \+ 8 \+ 24 \+ 24 rows\)"):
        load_model(dst)


def test_qwen3_next_fp8_fused_projections_are_dequantized_then_split(tmp_path):
    """The FP8 Qwen3-Next release block-quantizes in_proj_qkvz as one tensor: dequantized whole, then split."""
    hf = random_hf_moe_model("qwen3_next", TINY, seed=6)
    path = save_causal_lm_layout(hf, tmp_path / "next")
    name, block, expected = "model.layers.0.linear_attn.in_proj_qkvz.weight", 16, {}

    def quantize(tensors):
        tensors[name], tensors[name + "_scale_inv"], expected["qkvz"] = quantize_fp8(tensors[name], block)

    dst = copy_with(tmp_path, path, quantize)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(config))
    mine = load_model(dst, dtype="float32").model.layers[0].linear_attn
    with torch.no_grad():
        hf.model.layers[0].linear_attn.in_proj_qkvz.weight.copy_(expected["qkvz"])
    assert_split_like_transformers(hf.model.layers[0].linear_attn, mine)
