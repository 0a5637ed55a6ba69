"""Sparse-MoE models under tensor parallelism (TP = 2, gloo) against one process, on small random
checkpoints of both families and both expert layouts: every rank holds every expert with half its width
(gate|up rows, down columns) and half the shared expert, the router and shared_expert_gate whole, and one
all-reduce after the block; logits within 1e-5 and greedy tokens identical with the fused C++ step and with
the torch executor, MTP drafting through the MoE head; rank 0's weights are what `deltaserve plan --tp 2`
counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.engine.planner import plan_memory
from deltaserve.model.moe import SparseMoeBlock
from tests.checkpoints import MOE, TINY, random_hf_moe_model, random_mtp_tensors
from tests.test_moe_model import save
from tests.test_tensor_parallel import (
    MAX_LEN,
    SEQS,
    assert_logits_close,
    engines,
    greedy,
    logits_of_steps,
    ranks_hold_their_slices,
)

CASES = {  # family, config fields, layout, fused 3-D experts, MTP draft tokens, torch executor
    "qwen3_5_moe-per-expert-mtp-fused": ("qwen3_5_moe", {}, "official", False, 2, False),
    "qwen3_next-fused-experts-dense-layer-torch": ("qwen3_next", {"mlp_only_layers": [1]}, "causal", True, 0, True),
    "qwen3_next-per-expert-mtp-fused": ("qwen3_next", {"decoder_sparse_step": 2}, "causal", False, 2, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_experts_split_across_ranks(case: str, tmp_path: Path) -> None:
    family, fields, layout, fused, k, eager = CASES[case]
    hf = random_hf_moe_model(family, TINY, seed=len(case), **fields)
    mtp = random_mtp_tensors(TINY, seed=3, moe=MOE) if k else None
    path = save(hf, tmp_path, layout, fused, mtp)
    with engines(path, k=k, eager=eager) as (one, two):
        moe = next(layer.mlp for layer in two.model.model.layers if isinstance(layer.mlp, SparseMoeBlock))
        assert moe.experts.gate_up_proj.shape == (MOE["num_experts"], MOE["moe_intermediate_size"], TINY["hidden_size"])
        assert moe.shared_expert.down_proj.weight.shape[1] == MOE["shared_expert_intermediate_size"] // 2
        assert_logits_close(logits_of_steps(one, mtp=k > 0), logits_of_steps(two, mtp=k > 0))
        assert greedy(two) == greedy(one)
        if k:
            assert two.spec_metrics.num_drafts == one.spec_metrics.num_drafts > 0
            assert two.spec_metrics.accepted_per_position == one.spec_metrics.accepted_per_position
        cfg = ModelConfig.from_file(path)
        plan = plan_memory(cfg, MAX_LEN, SEQS, tp=2, dtype="float32", with_mtp=k > 0)
        weights = {p.data_ptr(): p.numel() * p.element_size() for p in two.model.parameters()}  # tied once
        assert sum(weights.values()) == plan.weight_bytes
        assert plan.weight_bytes < plan_memory(cfg, MAX_LEN, SEQS, dtype="float32", with_mtp=k > 0).weight_bytes


@pytest.mark.parametrize("family, layout, fused", [("qwen3_5_moe", "official", False), ("qwen3_5_moe", "causal", True),
                                                   ("qwen3_next", "causal", False)])
def test_each_rank_reads_its_part_of_the_experts(family: str, layout: str, fused: bool, tmp_path: Path) -> None:
    """Without a process group: each rank's parameters, read as safetensors slices from either expert layout
    (and from Qwen3-Next's fused in_proj_qkvz / in_proj_ba), are the whole model's split as the layers
    expect; joined, they give the whole model's back."""
    hf = random_hf_moe_model(family, TINY, seed=2)
    path = save(hf, tmp_path, layout, fused, random_mtp_tensors(TINY, seed=3, moe=MOE))
    whole, ranks, cfg = ranks_hold_their_slices(path)
    I = MOE["moe_intermediate_size"]  # noqa: E741
    for mlp in ("model.layers.0.mlp.", "mtp.layers.0.mlp."):
        gate_up = [ranks[r][mlp + "experts.gate_up_proj"] for r in range(2)]  # [E, I/2 gate | I/2 up, H]
        gates, ups = zip(*(g.split(I // 2, dim=1) for g in gate_up), strict=True)
        assert torch.equal(torch.cat(gates + ups, dim=1), whole[mlp + "experts.gate_up_proj"])
        down = mlp + "experts.down_proj"
        assert torch.equal(torch.cat([ranks[0][down], ranks[1][down]], dim=2), whole[down])
        shared = mlp + "shared_expert.down_proj.weight"
        assert torch.equal(torch.cat([ranks[0][shared], ranks[1][shared]], dim=1), whole[shared])
        for replicated in ("gate.weight", "shared_expert_gate.weight"):
            assert torch.equal(ranks[1][mlp + replicated], whole[mlp + replicated])
    qkv = "model.layers.0.linear_attn.in_proj_qkv.weight"  # each rank [q | k | v] of its key heads' groups
    kd, vd = cfg.linear_key_dim, cfg.linear_value_dim
    parts = [ranks[r][qkv].split([kd // 2, kd // 2, vd // 2]) for r in range(2)]
    assert torch.equal(torch.cat([torch.cat([p[i] for p in parts]) for i in range(3)]), whole[qkv])
