"""Planning sparse-MoE models: the Qwen3.5-35B-A3B (about 35B parameters, 3B active), total and active
bytes per decode token, experts split along their width for tensor parallelism, FP8 experts quantized
expert by expert, and the counts held to the models built here and by transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from deltaserve.cli_plan import main as plan_main
from deltaserve.config import ModelConfig
from deltaserve.engine.known_configs import known_config
from deltaserve.engine.planner import plan_memory, weight_parts
from deltaserve.model.decoder import Qwen3_5ForCausalLM
from deltaserve.ops.formats import WeightFormat
from tests.checkpoints import MOE, RATIOS_27B, TINY, hf_moe_config, random_mtp_tensors

H, LAYERS, E, K, IE, V = 2048, 40, 256, 8, 512, 248320


@pytest.fixture(scope="module")
def a3b() -> ModelConfig:
    return ModelConfig.from_dict(known_config("qwen3.5-35b-a3b"))


def test_35b_a3b_totals_and_active(a3b: ModelConfig) -> None:
    plan = plan_memory(a3b, 4096, 1)
    parts = {p.name: p for p in plan.weight_parts}
    assert parts["routed experts"].count == LAYERS and parts["routed experts"].params == E * 3 * H * IE
    assert parts["shared expert"].params == 3 * H * 512 and parts["MoE router"].params == E * H + H
    assert "MLP" not in parts  # every layer is sparse
    total = plan.text_params + plan.vision_params + plan.mtp_params
    assert total == pytest.approx(35e9, rel=0.03)
    # active: all but the routed experts not chosen (E - K of E) and all but one embedding row
    assert plan.active_params == plan.text_params - LAYERS * (E - K) * 3 * H * IE - (V - 1) * H
    assert plan.active_params == pytest.approx(3e9, rel=0.05)
    assert plan.active_weight_bytes == 2 * plan.active_params  # bf16, MTP and vision not read
    assert plan.weight_bytes == 2 * (plan.text_params + plan.vision_params)
    spec = plan_memory(a3b, 4096, 1, with_mtp=True)
    mtp_experts = (E - K) * 3 * H * IE
    assert spec.active_weight_bytes == plan.active_weight_bytes + 2 * (plan.mtp_params - mtp_experts)


def test_35b_a3b_tp4_splits_every_expert_along_its_width(a3b: ModelConfig) -> None:
    one, four = plan_memory(a3b, 4096, 1), plan_memory(a3b, 4096, 1, tp=4)
    assert (four.rank.expert_intermediate, four.rank.shared_expert_intermediate) == (IE // 4, 512 // 4)
    p1 = {p.name: p for p in one.weight_parts}
    p4 = {p.name: p for p in four.weight_parts}
    assert p4["routed experts"].bytes_per_rank * 4 == p1["routed experts"].bytes_per_rank
    assert p4["shared expert"].bytes_per_rank * 4 == p1["shared expert"].bytes_per_rank
    assert p4["MoE router"].bytes_per_rank == p1["MoE router"].bytes_per_rank  # replicated
    assert one.active_weight_bytes / 4 < four.active_weight_bytes < one.active_weight_bytes / 4 * 1.05


def test_35b_a3b_fp8_quantizes_each_expert_and_keeps_the_router() -> None:
    cfg = ModelConfig.from_dict(known_config("qwen3.5-35b-a3b-fp8"))
    parts = {p.name: p for p in weight_parts(cfg)}
    # The engine keeps fp8 scales per row and 128 columns (deltaserve/ops/formats.py): a block's scale once
    # per row it covers.
    scales = lambda rows, cols: rows * math.ceil(cols / 128)  # noqa: E731
    per_expert = 2 * IE * H + IE * H + (scales(2 * IE, H) + scales(H, IE)) * 4
    assert parts["routed experts"].bytes_per_rank == E * per_expert
    assert parts["MoE router"].bytes_per_rank == 2 * (E * H + H)  # bf16
    assert parts["routed experts"].active_bytes_per_rank == K * per_expert


def test_router_name_does_not_match_dense_gate_proj() -> None:
    """'mlp.gate' in modules_to_not_convert keeps the router, not the dense MLPs' gate_proj."""
    d = {**hf_moe_config("qwen3_next", TINY, mlp_only_layers=[1]).to_dict(), "architectures": None}
    d["dtype"] = "bfloat16"
    d["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16], "modules_to_not_convert":
                                ["mlp.gate", "mlp.shared_expert_gate", "lm_head", "embed_tokens"]}
    parts = {p.name: p for p in weight_parts(ModelConfig.from_dict(d))}
    H, I = TINY["hidden_size"], TINY["intermediate_size"]
    fp8 = WeightFormat("fp8", 16)  # one byte per weight, plus an fp32 scale per row and 16 columns
    assert parts["MLP"].bytes_per_rank == 2 * fp8.nbytes(I, H) + fp8.nbytes(H, I)
    assert parts["MoE router"].bytes_per_rank == 2 * parts["MoE router"].params  # kept in bf16


@pytest.mark.parametrize("family, fields", [("qwen3_5_moe", {}), ("qwen3_next", {"mlp_only_layers": [1]}),
                                            ("qwen3_next", {"decoder_sparse_step": 2})])
@pytest.mark.parametrize("shape", [TINY, RATIOS_27B])
def test_counts_match_the_built_models(family: str, fields: dict, shape: dict) -> None:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

    hf_cfg = hf_moe_config(family, shape, **fields)
    cfg = ModelConfig.from_dict({**hf_cfg.to_dict(), "architectures": None, "mtp_num_hidden_layers": 1})
    hf = (Qwen3_5MoeForCausalLM if family == "qwen3_5_moe" else Qwen3NextForCausalLM)(hf_cfg)
    plan = plan_memory(cfg, 64, 1, dtype="float32", with_mtp=True)
    assert plan.text_params == sum(p.numel() for p in hf.parameters())
    assert plan.mtp_params == sum(t.numel() for t in random_mtp_tensors(shape, moe=MOE).values())
    ours = Qwen3_5ForCausalLM(cfg, with_mtp=True)
    assert plan.text_params + plan.mtp_params == sum(p.numel() for p in ours.parameters())
    assert plan.weight_bytes == 4 * sum(p.count * p.params_per_rank for p in plan.weight_parts)


def test_cli_plan_known_moe_config_and_a_moe_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the text model's figures: without the MTP head, which the plan counts by default (engine/spec_default.py)
    assert plan_main(["plan", "--model", "qwen3.5-35b-a3b", "--max-model-len", "8192", "--max-num-seqs", "4",
                      "--no-speculative"]) == 0
    out = capsys.readouterr().out
    assert "sparse MoE: 40 of 40 layers, 256 experts, top-8" in out and "routed experts" in out
    assert "per decode token: reads 5.49 GiB of the 65.39 GiB loaded; active parameters 2.946 B" in out
    d = {**hf_moe_config("qwen3_next", RATIOS_27B, mlp_only_layers=[0]).to_dict(),
         "architectures": ["Qwen3NextForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert plan_main(["plan", "--model", str(tmp_path), "--max-model-len", "1024", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "sparse MoE: 7 of 8 layers, 8 experts, top-2" in out and "expert width 10" in out
