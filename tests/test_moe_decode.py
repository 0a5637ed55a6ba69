"""The MoE block's decode path (deltaserve/ops/csrc/moe.cpp, steps of at most kExpertParallelRows rows): its
one-loop routing against torch's softmax / topk / renormalisation (ties, near-ties, NaN, underflow), and the
block against the Python SparseMoeBlock (the reference) in every weight format, int8 activations included
(each token quantized once for all its experts), with tied router rows and experts no token picks holding NaN
weights (never read), at one row and at rows that share experts (gathered)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.config import ModelConfig
from deltaserve.model.linear import StoredWeights, store
from deltaserve.model.moe import SparseMoeBlock
from deltaserve.ops.formats import WeightFormat, quantize
from deltaserve.ops.fused_ext import load_extension
from tests.checkpoints import TINY, hf_moe_config


@pytest.fixture(scope="module", params=["native", "portable"])
def ext(request):
    return load_extension(portable=request.param == "portable")


def torch_route(logits: torch.Tensor, k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMoeBlock.route after the router: softmax in fp32, torch.topk, renormalised."""
    weights, ids = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True) if norm_topk else weights


def hard_logits(E: int, k: int) -> torch.Tensor:
    """Rows where torch.topk's tie-breaking decides: exact ties across the k-th place, a one-ulp gap there,
    a NaN, logits far below the largest (probabilities that underflow), and plain random rows."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(E, generator=g) * s for s in (0.1, 1.0, 5.0) for _ in range(8)]
    rows.append(torch.zeros(E))  # every expert ties
    rows.append(torch.randint(0, 3, (E,), generator=g).float())  # few values: ties straddle the k-th place
    if k < E:  # the k-th and (k+1)-th one ulp apart
        near = torch.randn(E, generator=g)
        top = near.sort(descending=True).values
        near[near == top[k]] = torch.nextafter(top[k - 1], torch.tensor(-float("inf")))
        rows.append(near)
    nan = torch.randn(E, generator=g)
    nan[3] = float("nan")
    rows.append(nan)
    far = torch.randn(E, generator=g)
    far[1:] -= 150.0  # all but one expert's probabilities underflow to 0: they tie in torch
    rows.append(far)
    return torch.stack(rows)


@pytest.mark.parametrize("E, k", [(128, 8), (8, 2), (4, 4), (64, 1)])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_the_routing_loop_chooses_as_torch(ext, E: int, k: int, norm_topk: bool) -> None:
    logits = hard_logits(E, k)
    ids, weights = ext.moe_route(logits, k, norm_topk)
    want_ids, want_weights = torch_route(logits, k, norm_topk)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-8, equal_nan=True)


def decode_block(fmt_name: str, seed: int) -> tuple[SparseMoeBlock, str]:
    """A TINY-shaped SparseMoeBlock (8 experts, top 2) whose weights are stored in fmt_name and, for int8 /
    int4, read int8 activations (returned: the setting); two router rows are equal (exact ties)."""
    cfg = ModelConfig.from_dict({**hf_moe_config("qwen3_5_moe", TINY).to_dict(), "architectures": None})
    torch.manual_seed(seed)
    block = SparseMoeBlock(cfg)
    fmt = WeightFormat.of(fmt_name)
    activations = "int8" if fmt_name in ("int8", "int4") else "none"
    with torch.no_grad():
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.3)
        block.gate.weight[5] = block.gate.weight[4]  # experts 4 and 5 tie for every token
        for name, module in block.named_modules():
            if not isinstance(module, StoredWeights) or name == "gate":  # the router stays fp32, as loaded
                continue
            values = {w: getattr(module, w).detach().clone() for w in module.WEIGHTS}
            store(module, fmt)
            for w, v in values.items():
                data, scale = quantize(v, fmt)
                getattr(module, w).copy_(data)
                if scale is not None:
                    module.scale(w).copy_(scale)
            module.activation_quantization = activations
    return block, activations


def moe_args(block: SparseMoeBlock) -> tuple:
    stored = {}
    for name, module in block.named_modules():
        if isinstance(module, StoredWeights):
            for w in module.WEIGHTS:
                f = module.fmt
                stored[f"{name}.{w}"] = (getattr(module, w).detach(), module.scale(w), f.name, f.group)
    router_shared = [stored[n] for n in ("gate.weight", "shared_expert.gate_proj.weight",
                                         "shared_expert.up_proj.weight", "shared_expert_gate.weight")]
    return (router_shared, stored["shared_expert.down_proj.weight"], stored["experts.gate_up_proj"],
            stored["experts.down_proj"], block.top_k, block.norm_topk_prob)


@pytest.mark.parametrize("rows", [1, 2, 9, 32])
@pytest.mark.parametrize("fmt_name", ["float32", "bfloat16", "int8", "int4"])
def test_the_decode_path_matches_the_python_block(ext, fmt_name: str, rows: int) -> None:
    block, activations = decode_block(fmt_name, seed=rows)
    x = torch.randn(rows, block.gate.weight.shape[1])
    with torch.no_grad():
        chosen = set(block.route(x)[0].flatten().tolist())
        unused = sorted(set(range(block.experts.num_experts)) - chosen)
        for name in block.experts.WEIGHTS:  # never read: NaN there would reach the output
            data, scale = getattr(block.experts, name), block.experts.scale(name)
            (data if data.is_floating_point() else scale)[unused] = float("nan")
        want = block(x)
    got = ext.moe_mlp(x, *moe_args(block), activation_quantization=activations)
    assert torch.isfinite(got).all()
    tol = 1e-4 if activations == "int8" else 1e-5
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if rows == 1:
        assert unused, "one row picks 2 of 8 experts"
