"""Loading: layouts, sharded index, dtypes, fp8 dequantization, and errors naming the tensor at fault."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltaserve.model.context import ForwardContext
from deltaserve.model.loader import CheckpointError, load_model
from tests.checkpoints import TINY, quantize_fp8, random_hf_model, random_mtp_tensors, save_official_layout


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    path = tmp_path_factory.mktemp("official")
    hf = random_hf_model(TINY, seed=7)
    save_official_layout(hf, path, random_mtp_tensors(TINY))
    return hf, path


def copy_with(tmp_path, src, edit) -> str:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(ids, ForwardContext.stateless([len(ids)])))


def test_sharded_index_loads_like_single_file(official, tmp_path):
    hf, path = official
    tensors = load_file(str(path / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    ids = torch.arange(20) % TINY["vocab_size"]
    assert torch.equal(logits(load_model(tmp_path), ids), logits(load_model(path), ids))


def test_vision_tensors_without_vision_config_are_skipped_with_a_log_line(official, tmp_path, caplog):
    _, path = official
    dst = copy_with(tmp_path, path, lambda t: t.update({"model.visual.blocks.0.attn.qkv.weight": torch.zeros(3, 3)}))
    with caplog.at_level("INFO"):
        assert load_model(dst).visual is None
    assert "vision tower" in caplog.text and "no vision_config" in caplog.text


def test_an_incomplete_vision_tower_names_what_is_missing(official, tmp_path):
    _, path = official
    dst = copy_with(tmp_path, path, lambda t: t.update({"model.visual.blocks.0.attn.qkv.weight": torch.zeros(6, 2)}))
    config = json.loads((dst / "config.json").read_text())
    config["vision_config"] = {"depth": 1, "hidden_size": 2 * 4, "num_heads": 2, "out_hidden_size": TINY["hidden_size"]}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): visual\."):
        load_model(dst)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_stays_close(official, dtype):
    hf, path = official
    model = load_model(path, dtype=dtype)
    assert model.lm_head.weight.dtype == getattr(torch, dtype)
    ids = torch.arange(30) % TINY["vocab_size"]
    ref = logits(load_model(path, dtype="float32"), ids)
    got = logits(model, ids)
    assert torch.isfinite(got).all()
    # random weights amplify rounding: transformers itself is off by ~7% of the max logit in bf16 here
    assert (got - ref).abs().max() < 0.15 * ref.abs().max()


def test_fp8_block_quantized_weights_are_dequantized(official, tmp_path):
    _, path = official
    block = 16
    expected = {}

    def quantize(tensors):
        for name in [n for n in tensors if "_proj" in n and n.endswith(".weight")]:
            tensors[name], tensors[name + "_scale_inv"], expected[name] = quantize_fp8(tensors[name], block)

    dst = copy_with(tmp_path, path, quantize)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(config))
    model = load_model(dst, dtype="float32")
    w = model.model.layers[0].linear_attn.in_proj_qkv.weight
    assert torch.equal(w, expected["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"])
    assert torch.isfinite(logits(model, torch.arange(10))).all()


def test_missing_tensor_is_named(official, tmp_path):
    _, path = official
    dst = copy_with(tmp_path, path, lambda t: t.pop("model.language_model.layers.2.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.2\.linear_attn\.A_log"):
        load_model(dst)


def test_unexpected_tensor_is_named(official, tmp_path):
    _, path = official
    dst = copy_with(tmp_path, path, lambda t: t.update({"model.language_model.layers.0.bogus.weight": torch.ones(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*layers\.0\.bogus\.weight"):
        load_model(dst)


def test_wrong_shape_is_named_with_both_shapes(official, tmp_path):
    _, path = official
    name = "model.language_model.layers.3.self_attn.q_proj.weight"
    dst = copy_with(tmp_path, path, lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(CheckpointError, match=r"q_proj\.weight' has shape \(127, 48\), expected \(128, 48\)"):
        load_model(dst)


def test_corrupt_file_is_named(official, tmp_path):
    _, path = official
    dst = tmp_path / "corrupt"
    shutil.copytree(path, dst)
    (dst / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        load_model(dst)
