"""Memory planner: the Qwen3.5-27B numbers of REFERENCE.md, tensor-parallel per-rank shapes, and agreement
with the bytes actually allocated (cache) and the parameters actually built (transformers)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from deltaserve.cache import dtypes
from deltaserve.cache.sizing import (
    gdn_state_bytes_per_seq,
    kv_bytes_per_block,
    kv_bytes_per_token_per_layer,
    num_blocks_for,
)
from deltaserve.cache.tensors import allocate_cache
from deltaserve.cli_plan import format_plan
from deltaserve.cli_plan import main as plan_main
from deltaserve.config import ConfigError, ModelConfig
from deltaserve.engine.known_configs import QWEN3_5_27B_CONFIG, QWEN3_5_27B_FP8_CONFIG, known_config
from deltaserve.engine.planner import plan_memory, weight_parts
from tests.checkpoints import RATIOS_27B, TINY, hf_config, random_mtp_tensors

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.fixture(scope="module")
def cfg27() -> ModelConfig:
    return ModelConfig.from_dict(QWEN3_5_27B_CONFIG)


def small_config(shape: dict, mtp: bool = True) -> ModelConfig:
    d = hf_config(shape).to_dict()
    d["model_type"] = "qwen3_5_text"
    d["mtp_num_hidden_layers"] = 1 if mtp else 0
    return ModelConfig.from_dict(d)


# ---- 27B -----------------------------------------------------------------------------------------------
def test_27b_layer_counts(cfg27: ModelConfig) -> None:
    plan = plan_memory(cfg27, 4096, 1)
    assert (plan.num_attention_layers, plan.num_gdn_layers, plan.num_kv_cache_layers) == (16, 48, 16)
    assert cfg27.attention_layer_ids[:2] == [3, 7]


def test_27b_kv_per_token(cfg27: ModelConfig) -> None:
    assert kv_bytes_per_token_per_layer(cfg27, "bfloat16") == 4 * KiB
    # fp8: one byte a value, and an fp32 scale per (token, kv head) of K and of V
    assert kv_bytes_per_token_per_layer(cfg27, "fp8") == 2 * KiB + 2 * 4 * 4
    assert plan_memory(cfg27, 4096, 1, "auto").kv_bytes_per_token == 16 * 4 * KiB
    assert plan_memory(cfg27, 4096, 1, "fp8").kv_bytes_per_token == 16 * (2 * KiB + 32)
    # speculating adds the MTP layer's own KV cache
    assert plan_memory(cfg27, 4096, 1, with_mtp=True).kv_bytes_per_token == 17 * 4 * KiB
    assert kv_bytes_per_block(cfg27, 16, torch.bfloat16) == 16 * 16 * 4 * KiB


def test_27b_gdn_state(cfg27: ModelConfig) -> None:
    plan = plan_memory(cfg27, 4096, 8)
    assert plan.gdn_recurrent_bytes_per_layer == 3 * MiB
    conv = (2 * 16 * 128 + 48 * 128) * 3 * 2  # conv_dim (K-1) bf16
    assert plan.gdn_conv_bytes_per_layer == conv
    assert plan.gdn_state_bytes_per_seq == 48 * (3 * MiB + conv)
    assert gdn_state_bytes_per_seq(cfg27, "bfloat16") == plan.gdn_state_bytes_per_seq
    assert plan.gdn_state_bytes == 8 * plan.gdn_state_bytes_per_seq
    # the state does not grow with the sequence
    assert plan_memory(cfg27, 262144, 8).gdn_state_bytes == plan.gdn_state_bytes


def test_27b_parameter_counts(cfg27: ModelConfig) -> None:
    plan = plan_memory(cfg27, 4096, 1)
    assert plan.text_params == pytest.approx(26.9e9, rel=0.01)
    assert plan.vision_params == pytest.approx(0.46e9, rel=0.01)
    assert plan.mtp_params == pytest.approx(0.42e9, rel=0.015)
    assert cfg27.vision is not None and plan.vision_params == cfg27.vision.num_parameters()
    # bf16: two bytes per parameter, MTP left out unless speculating
    assert plan.weight_bytes == 2 * (plan.text_params + plan.vision_params)
    spec = plan_memory(cfg27, 4096, 1, with_mtp=True, include_vision=False)
    assert spec.weight_bytes == 2 * (plan.text_params + plan.mtp_params)


def test_27b_tp4_per_rank(cfg27: ModelConfig) -> None:
    one, four = plan_memory(cfg27, 32768, 4), plan_memory(cfg27, 32768, 4, tp=4)
    r = four.rank
    assert (r.attention_heads, r.kv_heads, r.gdn_key_heads, r.gdn_value_heads) == (6, 1, 4, 12)
    assert (r.intermediate, r.vocab) == (17408 // 4, 248320 // 4)
    assert four.kv_bytes_per_token_per_layer == 1 * KiB
    assert four.gdn_recurrent_bytes_per_layer == 3 * MiB // 4
    assert four.gdn_conv_bytes_per_layer == one.gdn_conv_bytes_per_layer // 4
    assert four.kv_cache_bytes == one.kv_cache_bytes // 4
    # weights: almost all of the text model splits (only its norms are replicated); rank 0, which the plan
    # sizes, holds the whole bf16 vision tower besides
    tower = 2 * four.vision_params
    text_one, text_four = one.weight_bytes - tower, four.weight_bytes - tower
    assert text_one / 4 < text_four < text_one / 4 * 1.01


def test_tp_beyond_kv_heads_replicates(cfg27: ModelConfig) -> None:
    eight = plan_memory(cfg27, 4096, 1, tp=8)
    assert eight.rank.kv_heads == 1 and eight.kv_bytes_per_token_per_layer == 1 * KiB
    with pytest.raises(ConfigError, match="tensor parallel size 3"):
        plan_memory(cfg27, 4096, 1, tp=3)


def test_27b_fp8_weights() -> None:
    cfg = ModelConfig.from_dict(QWEN3_5_27B_FP8_CONFIG)
    parts = {p.name: p for p in weight_parts(cfg)}
    H, I = 5120, 17408
    scales = (2 * I * math.ceil(H / 128) + H * math.ceil(I / 128)) * 4  # fp32, per row and 128 columns
    assert parts["MLP"].bytes_per_rank == 3 * I * H + scales
    assert parts["embedding"].bytes_per_rank == 248320 * H * 2  # kept in bf16
    assert parts["lm_head"].bytes_per_rank == 248320 * H * 2
    plan = plan_memory(cfg, 4096, 1)
    assert plan.weight_dtype == "fp8"
    assert 27e9 < plan.weight_bytes < 33e9  # the released FP8 checkpoint is about 29-30 GB
    # dequantized on load: back to two bytes per parameter
    assert plan_memory(cfg, 4096, 1, weight_dtype="bfloat16").weight_bytes == plan_memory(
        ModelConfig.from_dict(QWEN3_5_27B_CONFIG), 4096, 1).weight_bytes


def test_plan_totals_and_format(cfg27: ModelConfig) -> None:
    plan = plan_memory(cfg27, 8192, 16, "fp8", tp=4, with_mtp=True, model_name="qwen3.5-27b")
    # rank 0 holds the vision encoder cache beside the tower, and the plan sizes rank 0
    assert plan.encoder_cache_bytes > 0
    assert plan.total_bytes == plan.weight_bytes + plan.kv_cache_bytes + plan.gdn_state_bytes + plan.encoder_cache_bytes
    assert plan.num_kv_blocks == 16 * 8192 // 16
    text = format_plan(plan, gpu_memory_bytes=80 * GiB)
    for needle in ("qwen3.5-27b", "GiB", "MiB", "per token per layer", "768.00 KiB", "KV blocks fit",
                   "rank 0 holds it and the whole tower", "(rank 0 only"):
        assert needle in text


def test_bad_arguments(cfg27: ModelConfig) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        plan_memory(cfg27, 4096, 1, kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="max_model_len"):
        plan_memory(cfg27, 0, 1)


# ---- small configs against real allocations and real models ---------------------------------------------
@pytest.mark.parametrize("shape", [TINY, RATIOS_27B])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_mtp", [False, True])
def test_matches_allocated_cache(shape: dict, dtype: torch.dtype, with_mtp: bool) -> None:
    cfg = small_config(shape)
    num_blocks, block_size, slots = 7, 16, 3
    cache = allocate_cache(cfg, num_blocks, block_size, slots, dtype=dtype, with_mtp=with_mtp)

    def nbytes(ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    kv = nbytes(t for pair in cache.kv.values() for t in pair)
    state = nbytes(cache.conv.values()) + nbytes(cache.ssm.values())
    assert kv == num_blocks * kv_bytes_per_block(cfg, block_size, dtype, with_mtp=with_mtp)
    assert state == slots * gdn_state_bytes_per_seq(cfg, dtype)
    assert num_blocks_for(kv + 5, cfg, block_size, dtype, with_mtp=with_mtp) == num_blocks
    plan = plan_memory(cfg, 7 * block_size, 1, tp=1, block_size=block_size, with_mtp=with_mtp, dtype=dtype)
    assert plan.kv_cache_bytes == kv and plan.gdn_state_bytes * slots == state


@pytest.mark.parametrize("with_mtp", [False, True])
def test_fp8_kv_sizes_count_the_row_scales(with_mtp: bool) -> None:
    """An fp8 KV cache: one byte per K/V value plus one fp32 scale per (token, kv head) of K and of V, and
    the GDN conv state kept in fp32. The planner, the engine's pool sizing (plan_cache) and the allocation
    count the same bytes."""
    from deltaserve.cache.sizing import CacheOptions, plan_cache

    cfg = small_config(RATIOS_27B)
    num_blocks, block_size, slots = 7, 16, 3
    cache = allocate_cache(cfg, num_blocks, block_size, slots, dtype=torch.float8_e4m3fn, with_mtp=with_mtp)
    kv = sum(t.numel() * t.element_size() for pair in [*cache.kv.values(), *cache.kv_scales.values()] for t in pair)
    state = sum(t.numel() * t.element_size() for t in [*cache.conv.values(), *cache.ssm.values()])
    per_token_layer = 2 * cfg.num_key_value_heads * (cfg.head_dim + 4)
    assert kv_bytes_per_block(cfg, block_size, "fp8", with_mtp=with_mtp) == block_size * per_token_layer * len(
        cache.kv)
    assert kv == num_blocks * kv_bytes_per_block(cfg, block_size, "fp8", with_mtp=with_mtp)
    assert state == slots * gdn_state_bytes_per_seq(cfg, torch.float32)
    plan = plan_memory(cfg, num_blocks * block_size, 1, kv_cache_dtype="fp8", block_size=block_size,
                       with_mtp=with_mtp, dtype="float32")
    assert plan.kv_cache_bytes == kv and plan.gdn_state_bytes * slots == state
    budget = kv + state
    opts = CacheOptions(block_size=block_size, max_num_seqs=slots, max_model_len=block_size, kv_cache_memory=budget,
                        num_kv_blocks=None, enable_prefix_caching=False)
    assert plan_cache(cfg, torch.float8_e4m3fn, opts, with_mtp=with_mtp).num_blocks == 3  # max_num_seqs x 1 block
    opts.max_model_len = num_blocks * block_size  # exactly the budget: 7 blocks beside the 3 slots
    opts.max_num_seqs = slots
    assert plan_cache(cfg, torch.float8_e4m3fn, opts, with_mtp=with_mtp).num_blocks == num_blocks


@pytest.mark.parametrize("shape", [TINY, RATIOS_27B])
def test_parameter_count_matches_transformers(shape: dict) -> None:
    from transformers import Qwen3_5ForCausalLM

    cfg = small_config(shape)
    model = Qwen3_5ForCausalLM(hf_config(shape))
    plan = plan_memory(cfg, 64, 1, dtype="float32", with_mtp=True)
    assert plan.text_params == sum(p.numel() for p in model.parameters())
    assert plan.mtp_params == sum(t.numel() for t in random_mtp_tensors(shape).values())


@pytest.mark.parametrize("tie, mtp, tp", [(False, True, 1), (True, False, 1), (False, True, 2)],
                         ids=["untied-with-mtp", "tied", "tp2-rank0"])
def test_fp32_plan_of_a_bf16_checkpoint(tie: bool, mtp: bool, tp: int, tmp_path: Path) -> None:
    """Computing a bf16 checkpoint in fp32: weights count 4 bytes each, and the fused step adds nothing (it
    reads the weights as loaded: every matrix its stacks hold is a parameter or a cache tensor; under tensor
    parallelism, rank 0's stacks, built without a process group)."""
    from deltaserve.executor.fused_cpu.stack import FusedMTP, FusedTrunk
    from deltaserve.model.loader import load_model
    from deltaserve.model.parallel import Shard
    from deltaserve.model.sharding import rank_config
    from tests.checkpoints import random_hf_model, save_official_layout

    hf = random_hf_model(TINY, seed=3, tie=tie).to(torch.bfloat16)
    mtp_tensors = {k: v.bfloat16() for k, v in random_mtp_tensors(TINY).items()} if mtp else None
    path = save_official_layout(hf, tmp_path, mtp_tensors)
    cfg = ModelConfig.from_file(path)
    plan = plan_memory(cfg, 64, 1, dtype="float32", with_mtp=mtp, tp=tp)
    bf16 = plan_memory(cfg, 64, 1, with_mtp=mtp, tp=tp)
    assert plan.weight_dtype == "float32" and plan.weight_bytes == 2 * bf16.weight_bytes
    assert plan.total_bytes == plan.weight_bytes + plan.cache_bytes
    assert "fused" not in format_plan(plan)

    model = load_model(path, dtype="float32", with_mtp=mtp, shard=Shard(0, tp))
    cache = allocate_cache(rank_config(cfg, tp), num_blocks=4, block_size=16, num_slots=1, with_mtp=mtp)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    caches = {t.untyped_storage().data_ptr() for t in [*cache.conv.values(), *cache.ssm.values()]}
    caches |= {t.untyped_storage().data_ptr() for pair in cache.kv.values() for t in pair}
    held = FusedTrunk(model, cache).named_tensors() + (FusedMTP(model, cache).named_tensors() if mtp else [])
    assert [name for name, t in held if t.dim() >= 2 and t.untyped_storage().data_ptr() not in params | caches] == []


def test_vision_count_matches_transformers() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionConfig, Qwen3_5VisionModel

    vc = dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=48, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=64)
    d = {"model_type": "qwen3_5", "text_config": hf_config(TINY).to_dict(), "vision_config": vc}
    d["text_config"]["model_type"] = "qwen3_5_text"
    cfg = ModelConfig.from_dict(d)
    plan = plan_memory(cfg, 64, 1, dtype="float32")
    vision = Qwen3_5VisionModel(Qwen3_5VisionConfig(**vc))
    assert plan.vision_params == sum(p.numel() for p in vision.parameters())


# ---- CLI -----------------------------------------------------------------------------------------------
def test_cli_plan_known_config(capsys: pytest.CaptureFixture[str]) -> None:
    rc = plan_main(["plan", "--model", "qwen3.5-27b", "--max-model-len", "32768", "--max-num-seqs", "8",
                    "--kv-cache-dtype", "fp8", "--tp", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and "tensor parallel 4" in out and "520 B" in out  # 256 fp8 values and a scale, K and V
    # the engine speculates by default on a checkpoint this size (engine/spec_default.py): so does the plan
    assert "(+ MTP layer with its own KV cache)" in out
    assert plan_main(["plan", "--model", "qwen3.5-27b", "--no-speculative"]) == 0
    assert "MTP layer" not in capsys.readouterr().out
    assert plan_main(["plan"]) == 0  # the demo: too small to speculate by default
    assert "MTP layer" not in capsys.readouterr().out


def test_cli_plan_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(known_config("qwen3.5-27b")))
    assert plan_main(["plan", "--model", str(path), "--max-model-len", "1024", "--max-num-seqs", "1"]) == 0
    assert plan_main(["plan", "--model", str(tmp_path), "--max-model-len", "1024"]) == 0
    assert plan_main(["plan", "--model", str(tmp_path / "nope")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_module_exports() -> None:
    from deltaserve import cli_plan

    assert cli_plan.KV_CACHE_DTYPES is dtypes.KV_CACHE_DTYPES  # one table
    assert dtypes.dtype_bytes(torch.float8_e4m3fn) == 1 and dtypes.dtype_bytes("bf16") == 2


def test_weight_inventory_is_the_built_model() -> None:
    """Every parameter of the model the engine builds is counted once, with its shape (no copied shapes)."""
    from deltaserve.model.decoder import Qwen3_5ForCausalLM

    cfg = small_config(TINY)
    model = Qwen3_5ForCausalLM(cfg, with_mtp=True)
    built = sum(p.numel() for p in model.parameters())  # tied weights once
    parts = {p.name: p for p in weight_parts(cfg, with_mtp=True, include_vision=False)}
    counted = sum(p.total_params for p in parts.values() if p.name != "vision tower")
    assert counted == built
    assert parts["GDN mixer"].count == len(cfg.gdn_layer_ids)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_decode_reads_the_head(tie: bool) -> None:
    """A decode token reads one row of an untied embedding, and all of the lm_head, which for a tied model
    is the embedding itself; every other text weight whole."""
    cfg = ModelConfig.from_dict(hf_config(TINY).to_dict() | {"model_type": "qwen3_5_text", "tie_word_embeddings": tie})
    parts = {p.name: p for p in weight_parts(cfg, with_mtp=False, include_vision=False)}
    embedding, head = parts.pop("embedding"), parts.pop("lm_head")
    assert head.count == (0 if tie else 1)
    rows = -(-cfg.vocab_size // 64) * 64  # the vocabulary padded as vLLM pads it (model/sharding.py)
    read = embedding.bytes_per_rank if tie else head.bytes_per_rank + embedding.bytes_per_rank // rows
    assert embedding.total_active_bytes_per_rank + head.total_active_bytes_per_rank == read
    assert all(p.active_bytes_per_rank == p.bytes_per_rank for p in parts.values())
    plan = plan_memory(cfg, 64, 1)
    assert plan.active_params == plan.text_params - (0 if tie else (cfg.vocab_size - 1) * cfg.hidden_size)
