"""Weights are stored once, in their format (deltaserve/model/linear.py, the loader): a bf16 checkpoint stays
bf16, an fp8 one fp8, --quantization quantizes as it loads; the Python model computes exactly as if its
weights were their dequantized values."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.model.context import ForwardContext
from deltaserve.model.linear import KEEP_UNQUANTIZED, Linear, StoredWeights
from deltaserve.model.loader import load_model
from tests.checkpoints import TINY, quantize_fp8, random_hf_model, random_mtp_tensors, save_official_layout

IDS = torch.arange(23) % TINY["vocab_size"]


def _bf16_checkpoint(path, tie=False):
    hf = random_hf_model(TINY, seed=11, tie=tie)
    save_official_layout(hf, path, random_mtp_tensors(TINY))
    tensors = {n: t.to(torch.bfloat16) for n, t in load_file(str(path / "model.safetensors")).items()}
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    for section in (config, config.get("text_config", {})):
        for key in ("torch_dtype", "dtype"):
            if key in section:
                section[key] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return _bf16_checkpoint(tmp_path_factory.mktemp("bf16"))


def logits(model, ids=IDS):
    with torch.no_grad():
        return model.compute_logits(model(ids, ForwardContext.stateless([len(ids)])))


def stored(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, StoredWeights)}


def test_a_bf16_checkpoint_stays_bf16_and_computes_as_its_widened_weights(bf16_checkpoint):
    model = load_model(bf16_checkpoint)
    for name, m in stored(model).items():
        assert m.weight.dtype == torch.bfloat16 and m.fmt.name == "bfloat16", name
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "norm" in n or "A_log" in n)
    wide = load_model(bf16_checkpoint, dtype="float32")  # asked for fp32 weights: widened once
    assert all(m.weight.dtype == torch.float32 for m in stored(wide).values())
    assert torch.equal(logits(model), logits(wide))


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_quantized_projections_compute_as_their_dequantized_weights(bf16_checkpoint, quantization):
    """(int8 / int4 with their float rows: activation quantization is tests/test_int8_activations.py's)"""
    model = load_model(bf16_checkpoint, quantization=quantization,
                       activation_quantization=None if quantization == "fp8" else "none")
    ref = load_model(bf16_checkpoint, dtype="float32")
    ref_modules = stored(ref)
    for name, m in stored(model).items():
        kept = any(name.endswith(k) for k in KEEP_UNQUANTIZED) or not isinstance(m, Linear)
        assert m.fmt.name == ("bfloat16" if kept else quantization), name
        for attr in m.WEIGHTS:
            with torch.no_grad():
                getattr(ref_modules[name], attr).copy_(m.weight_values(attr))
    assert torch.equal(logits(model), logits(ref))
    # (How close each format stays to bf16 is measured on the trained demo: tests/test_quality.py.)


def test_the_lm_head_can_stay_unquantized(bf16_checkpoint):
    model = load_model(bf16_checkpoint, quantization="int8", quantize_lm_head=False)
    assert model.lm_head.fmt.name == "bfloat16"
    assert model.model.layers[0].mlp.gate_proj.fmt.name == "int8"


def test_a_tied_quantized_head_is_the_embedding(tmp_path):
    path = _bf16_checkpoint(tmp_path, tie=True)
    model = load_model(path, quantization="int4", group_size=16)
    embed, head = model.model.embed_tokens, model.lm_head
    assert embed.weight is head.weight and embed.weight_scale is head.weight_scale  # one tensor
    assert head.fmt.name == "int4" and head.fmt.group == 16
    rows = torch.tensor([3, 0, 3])
    assert torch.equal(embed(rows), head.weight_values()[rows])
    assert embed(rows).dtype == torch.float32


def test_an_fp8_checkpoint_stays_fp8(bf16_checkpoint, tmp_path):
    block = 16
    tensors = load_file(str(bf16_checkpoint / "model.safetensors"))
    expected = {}
    for name in [n for n in tensors if "_proj" in n and n.endswith(".weight") and "in_proj_" not in n[-16:-7]]:
        tensors[name], tensors[name + "_scale_inv"], expected[name] = quantize_fp8(tensors[name].float(), block)
    dst = tmp_path / "fp8"
    dst.mkdir()
    for f in bf16_checkpoint.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(config))
    model = load_model(dst)
    o_proj = model.model.layers[3].self_attn.o_proj
    assert o_proj.fmt.name == "fp8" and o_proj.fmt.group == block and o_proj.weight.dtype == torch.float8_e4m3fn
    name = "model.language_model.layers.3.self_attn.o_proj.weight"
    assert torch.equal(o_proj.weight, tensors[name])  # the checkpoint's own bytes
    assert torch.equal(o_proj.weight_values(), expected[name])
    assert torch.equal(logits(model), logits(load_model(dst, dtype="float32")))


def test_bad_quantization_is_named(bf16_checkpoint):
    with pytest.raises(ValueError, match="int3"):
        load_model(bf16_checkpoint, quantization="int3")
    with pytest.raises(ValueError, match="even"):
        load_model(bf16_checkpoint, quantization="int4", group_size=7)


@pytest.mark.parametrize("quantization", [None, "int8", "int4", "fp8"])
def test_the_planner_counts_the_bytes_the_engine_stores(bf16_checkpoint, quantization):
    from deltaserve.config import ModelConfig
    from deltaserve.engine.planner import weight_parts

    model = load_model(bf16_checkpoint, quantization=quantization)
    cfg = ModelConfig.from_file(bf16_checkpoint)
    parts = {p.name: p for p in weight_parts(cfg, quantization=quantization)}

    def nbytes(module):
        return sum(p.numel() * p.element_size() for p in module.parameters())

    assert parts["MLP"].bytes_per_rank == nbytes(model.model.layers[0].mlp)
    # (lm_head: the plan counts vLLM's vocabulary padded to 64 rows, which one process does not allocate)
    gdn = model.model.layers[0].linear_attn
    projections = [gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a, gdn.out_proj]
    others = sum(p.numel() for n, p in gdn.named_parameters() if not n.startswith(("in_proj", "out_proj")))
    assert parts["GDN mixer"].bytes_per_rank == sum(map(nbytes, projections)) + others * 2  # bf16 in the plan
