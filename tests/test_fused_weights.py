"""How the fused C++ step takes the model's weights (deltaserve/executor/fused_cpu/stack.py, ops/csrc/stack.cpp):
by name, each checked against the shape the config gives it, read where they are and in their stored format
(the model's parameters are not rewritten, and no copy of any weight is made)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cache.tensors import allocate_cache
from deltaserve.executor.fused_cpu.stack import DIMS, FusedMTP, FusedTrunk, _layer_weights
from deltaserve.model.linear import StoredWeights
from deltaserve.model.loader import load_model
from deltaserve.ops.fused_ext import load_extension
from tests.checkpoints import RATIOS_27B, TINY, random_hf_model, random_mtp_tensors, save_official_layout


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def model(request, tmp_path_factory):
    hf = random_hf_model(RATIOS_27B, seed=7)
    mtp = random_mtp_tensors(RATIOS_27B)
    path = save_official_layout(hf, tmp_path_factory.mktemp(request.param), mtp)
    model = load_model(path, dtype="float32", with_mtp=True)
    if request.param == "bf16":  # every 2-D weight stored as bf16, as a bf16 checkpoint loads
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, StoredWeights):
                    module.weight = torch.nn.Parameter(module.weight.detach().bfloat16(), requires_grad=False)
    return model


def small_cache(model):
    return allocate_cache(model.config, num_blocks=8, block_size=16, num_slots=2, with_mtp=True)


def test_building_the_fused_step_leaves_the_model_parameters_as_they_are(model) -> None:
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    cache = small_cache(model)
    FusedTrunk(model, cache)
    FusedMTP(model, cache)
    for name, p in model.named_parameters():
        ptr, values = before[name]
        assert p.data_ptr() == ptr, f"{name} was moved"
        assert torch.equal(p.detach(), values), f"{name} was changed"


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_the_fused_step_keeps_no_copy_of_the_weights(model) -> None:
    """Every matrix the C++ stacks hold is a model parameter or a cache tensor itself, in its stored dtype;
    what they hold of their own is a few vectors (1 + norm weight, the screen's row norms)."""
    cache = small_cache(model)
    shared = {storage(p) for p in model.parameters()}
    shared |= {storage(t) for pair in cache.kv.values() for t in pair}
    shared |= {storage(t) for t in [*cache.conv.values(), *cache.ssm.values()]}
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bf16 = model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    for fused in (FusedTrunk(model, cache), FusedMTP(model, cache)):
        held = fused.named_tensors()
        own = {storage(t): (name, t) for name, t in held if storage(t) not in shared}
        assert [n for n, t in own.values() if t.dim() >= 2] == []
        assert sum(t.untyped_storage().nbytes() for _, t in own.values()) <= 0.01 * param_bytes
        weights = [t for name, t in held if name.endswith(".weight") and t.dim() == 2 and "conv1d" not in name]
        assert {t.dtype for t in weights} == {torch.bfloat16 if bf16 else torch.float32}


def replace_weight(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    setattr(module, name, torch.nn.Parameter(value, requires_grad=False))


@pytest.fixture()
def tiny(tmp_path):
    return load_model(save_official_layout(random_hf_model(TINY, seed=8), tmp_path), dtype="float32")


def test_a_swapped_or_misshaped_weight_is_named_in_the_error(tiny) -> None:
    cache = allocate_cache(tiny.config, num_blocks=4, block_size=16, num_slots=1)
    gdn = tiny.model.layers[1].linear_attn
    z, b = gdn.in_proj_z.weight, gdn.in_proj_b.weight
    gdn.in_proj_z.weight, gdn.in_proj_b.weight = b, z  # [4, 48] and [48, 48] swapped
    with pytest.raises(RuntimeError, match=r"layer 1 linear_attn.in_proj_z.weight: expected \[48, 48\] got \[4, 48\]"):
        FusedTrunk(tiny, cache)
    gdn.in_proj_z.weight, gdn.in_proj_b.weight = z, b

    conv = gdn.conv1d.weight  # [conv_dim, 1, K]: drop a tap
    replace_weight(gdn.conv1d, "weight", conv.detach()[:, :, 1:].contiguous())
    with pytest.raises(RuntimeError, match=r"layer 1 linear_attn.conv1d.weight: expected \[80, 4\] got \[80, 3\]"):
        FusedTrunk(tiny, cache)
    replace_weight(gdn.conv1d, "weight", conv.detach())

    attn = tiny.model.layers[3].self_attn  # k_norm [16] on a model whose k_norm would be [8]
    q_norm = attn.q_norm.weight
    replace_weight(attn.q_norm, "weight", q_norm.detach()[:8].clone())
    with pytest.raises(RuntimeError, match=r"layer 3 self_attn.q_norm.scale: expected \[16\] got \[8\]"):
        FusedTrunk(tiny, cache)
    replace_weight(attn.q_norm, "weight", q_norm.detach())

    down = tiny.model.layers[0].mlp.down_proj
    weight = down.weight
    replace_weight(down, "weight", weight.detach().t().contiguous().t())  # same values, column-major
    with pytest.raises(RuntimeError, match="layer 0 mlp.down_proj.weight must be contiguous"):
        FusedTrunk(tiny, cache)
    replace_weight(down, "weight", weight.detach())
    FusedTrunk(tiny, cache)  # all put back: it builds


def test_missing_unexpected_and_misnamed_inputs_are_errors(tiny) -> None:
    cfg, ext = tiny.config, load_extension()
    cache = allocate_cache(cfg, num_blocks=4, block_size=16, num_slots=1)
    text = tiny.model
    dims = {name: getattr(cfg, name) for name in DIMS}
    head = {"embed_tokens.weight": text.embed_tokens.weight.detach(), "norm.scale": text.norm.weight.detach() + 1,
            "rotary.inv_freq": text.rotary.inv_freq, "rotary.axis": text.rotary.axis,
            "lm_head.weight": tiny.lm_head.weight.detach()}
    types = [layer.layer_type for layer in text.layers]
    with torch.no_grad():
        layers = [_layer_weights(layer, cache) for layer in text.layers]

    def build(dims=dims, head=head, types=types, layers=layers):
        return ext.FusedStack(dims, cfg.rms_norm_eps, head, types, layers, False)

    build()
    with pytest.raises(RuntimeError, match="missing dim head_dim"):
        build(dims={k: v for k, v in dims.items() if k != "head_dim"})
    with pytest.raises(RuntimeError, match="unexpected dim head_size"):
        build(dims=dims | {"head_size": 16})
    with pytest.raises(RuntimeError, match=r"missing tensor lm_head.weight \[96, 48\]"):
        build(head={k: v for k, v in head.items() if k != "lm_head.weight"})
    with pytest.raises(RuntimeError, match=r"rotary.axis\[0\] = 3, not a position row"):
        build(head=head | {"rotary.axis": torch.full_like(text.rotary.axis, 3)})
    with pytest.raises(RuntimeError, match="unexpected tensor fc.weight"):
        build(head=head | {"fc.weight": torch.zeros(48, 96)})
    with pytest.raises(RuntimeError, match="layer 2 unexpected tensor mlp.gate_proj.bias"):
        build(layers=layers[:2] + [layers[2] | {"mlp.gate_proj.bias": torch.zeros(80)}] + layers[3:])
    with pytest.raises(RuntimeError, match="layer 0 missing tensor ssm_cache"):
        build(layers=[{k: v for k, v in layers[0].items() if k != "ssm_cache"}] + layers[1:])
    with pytest.raises(RuntimeError, match="layer 3 self_attn.k_proj.weight is Half, not a weight format's data"):
        build(layers=layers[:3] + [layers[3] | {"self_attn.k_proj.weight": layers[3]["self_attn.k_proj.weight"]
                                                .half()}])
    int8 = layers[3]["self_attn.k_proj.weight"].to(torch.int8)
    with pytest.raises(RuntimeError, match="layer 3 self_attn.k_proj.weight is int8 but "
                                           "self_attn.k_proj.weight_scale is missing"):
        build(layers=layers[:3] + [layers[3] | {"self_attn.k_proj.weight": int8}])
    scale = torch.ones(int8.shape[0], 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="layer 3 self_attn.k_proj.weight: int8 needs a group size > 0"):
        build(layers=layers[:3] + [layers[3] | {"self_attn.k_proj.weight": int8,
                                                "self_attn.k_proj.weight_scale": scale}])
    with pytest.raises(RuntimeError, match="layer 0 has type mamba"):
        build(types=["mamba"] + types[1:])
    with pytest.raises(RuntimeError, match="layer 3 missing tensor linear_attn"):  # an attention layer as GDN
        build(types=types[:3] + ["linear_attention"])
