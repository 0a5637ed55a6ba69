"""The fused executor's vision tower (deltaserve/executor/fused_cpu/vision.py) against the torch tower it reads
(model/vision.py, the reference) and transformers: for a bf16 checkpoint, a
small call in fp32 in the C++ step within fp32's rounding and a larger one as bf16 dot products within bf16's
rounding (patch embedding included); and the fp32 scheme for an fp32 or quantized one, within fp32's rounding."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deltaserve import LLM
from deltaserve.executor.fused_cpu import vision as fast_vision
from deltaserve.executor.fused_cpu.vision import KEPT_FRAME_SIZES
from deltaserve.model import vision as vision_model
from deltaserve.model.vision import attend_bf16
from tests.test_vision_tower import GRIDS, _pixels
from tests.vision_checkpoint import VISION, random_hf_vision_model, save_vision_checkpoint

# Each matrix product's op (under inference mode a linear reaches the dispatcher whole) -> its weight argument.
MATMULS = {torch.ops.aten.linear.default: 1, torch.ops.aten.addmm.default: 2, torch.ops.aten.mm.default: 1}
CONVERSIONS = (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default)


class MatmulDtypes(TorchDispatchMode):
    """Records the dtype of every matrix product that runs under it, and the shape of every tensor converted
    to another dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []
        self.converted: list[tuple[int, ...]] = []
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        if func in MATMULS:
            self.dtypes.append(args[MATMULS[func]].dtype)
        if func in CONVERSIONS:  # a conversion reaches the dispatcher as `to` under inference mode
            target = args[1] if func is torch.ops.aten.to.dtype else (kwargs or {}).get("dtype")
            if target is not None and target != args[0].dtype:
                self.converted.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def hf():
    return random_hf_vision_model(seed=5)


def _encode(llm: LLM, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, MatmulDtypes]:
    """(the executor's tower output, the torch reference's, what the executor's tower ran on a second call: the
    first makes the grids' position tables)."""
    engine = llm.engine
    assert engine.executor.name == "fused-cpu"
    with torch.inference_mode():
        engine.executor.encode_images(pixels, GRIDS)
        with MatmulDtypes() as seen:
            fast = engine.executor.encode_images(pixels, GRIDS)
        reference = engine.model.encode_images(pixels, GRIDS)
    return fast, reference, seen


def _close(fast: torch.Tensor, reference: torch.Tensor, tol: float) -> None:
    """Within tol of the output's scale (and relatively)."""
    torch.testing.assert_close(fast, reference, atol=tol * reference.abs().max().item(), rtol=tol)


def test_fp32_tower_runs_in_the_cpp_step_within_fp32_rounding_of_the_reference_and_transformers(hf, tmp_path):
    llm = LLM(str(save_vision_checkpoint(hf, tmp_path / "ck")), enable_prefix_caching=False)
    pixels = _pixels(GRIDS, llm.engine.model.visual.config.patch_dim)
    fast, reference, seen = _encode(llm, pixels)
    assert seen.dtypes == [] and fast.dtype == torch.float32  # no torch product: the fp32 scheme
    _close(fast, reference, 1e-4)
    with torch.no_grad():
        theirs = hf.model.visual(pixels, grid_thw=torch.tensor(GRIDS)).pooler_output
    _close(fast, theirs, 1e-4)
    # The frame sizes' kept tables give the same numbers again; more sizes than are kept evict the oldest.
    model, tower = llm.engine.model, llm.engine.executor._vision
    with torch.inference_mode():
        assert torch.equal(llm.engine.executor.encode_images(pixels, GRIDS), fast)
        for grid in [(1, 2, 2), (2, 2, 4), (1, 4, 2), (1, 4, 4), (1, 6, 2), (1, 2, 2)]:
            one = _pixels([grid], model.visual.config.patch_dim, seed=1)
            _close(tower(one, [grid]), model.encode_images(one, [grid]), 1e-4)
    assert len(tower._tables) == KEPT_FRAME_SIZES


@pytest.fixture(scope="module")
def bf16_llm(hf, tmp_path_factory):
    path = save_vision_checkpoint(copy.deepcopy(hf).to(torch.bfloat16), tmp_path_factory.mktemp("ck16") / "ck")
    return LLM(str(path), enable_prefix_caching=False)


def test_small_bf16_tower_call_runs_in_fp32_in_the_cpp_step_within_fp32_rounding(bf16_llm):
    """GRIDS' 164 patches x width 32 are under SMALL_CALL_VALUES: the fp32 scheme, no torch product at all, and
    the reference's fp32 numbers (bf16 weights widened exactly) up to the order of the sums: within 1e-4 of the
    output's scale, where the bf16 scheme is held to 2e-2."""
    visual = bf16_llm.engine.model.visual
    pixels = _pixels(GRIDS, visual.config.patch_dim)
    assert pixels.shape[0] * visual.config.hidden_size <= fast_vision.SMALL_CALL_VALUES
    fast, reference, seen = _encode(bf16_llm, pixels)
    assert seen.dtypes == [] and fast.dtype == torch.float32
    scale = reference.abs().max().item()
    torch.testing.assert_close(fast, reference, atol=1e-4 * scale, rtol=1e-4)
    # It reads the model's own tensors: the stored bf16 weights, the fp32 biases and the conv weight, no copies.
    tower = bf16_llm.engine.executor._vision
    (weight, _, fmt, _), bias, activations = tower.fp32_blocks[0][1]  # the first block's qkv
    qkv = visual.blocks[0].attn.qkv
    assert fmt == "bfloat16" and weight.data_ptr() == qkv.weight.data_ptr() and bias.data_ptr() == qkv.bias.data_ptr()
    assert activations == "none"
    assert tower.fp32_patch[0][0].data_ptr() == visual.patch_embed.proj.weight.data_ptr()


def test_bf16_tower_runs_bf16_dot_products_within_bf16_rounding(bf16_llm, monkeypatch):
    monkeypatch.setattr(fast_vision, "SMALL_CALL_VALUES", 0)  # every call as a large one
    llm = bf16_llm
    visual = llm.engine.model.visual
    assert visual.blocks[0].attn.qkv.weight.dtype == torch.bfloat16  # stored as the checkpoint has it
    fast, reference, seen = _encode(llm, _pixels(GRIDS, visual.config.patch_dim))
    # Every product in bf16: the patch embedding, 4 projections per block, the merger's 2.
    assert seen.dtypes == [torch.bfloat16] * (1 + 4 * VISION["depth"] + 2)
    # No bias (nor any other 1-D tensor) is converted per call: the biases' bf16 copies are made once.
    assert seen.converted and all(len(shape) > 1 for shape in seen.converted)
    # torch runs the merger's exact GELU; the blocks' tanh GELU runs in the C++ step's bf16 kernel.
    assert seen.ops[torch.ops.aten.gelu_.default] == 1 and seen.ops[torch.ops.aten.gelu.default] == 0
    # The attention is the C++ step's bf16 kernel where the build has it, else torch's SDPA (in bf16).
    sdpa = sum(n for op, n in seen.ops.items() if "scaled_dot_product" in str(op))
    assert (sdpa == 0) == llm.engine.executor._vision.ext.BF16_PAIR_KERNEL
    assert fast.dtype == torch.float32 and not torch.equal(fast, reference)
    scale = reference.abs().max().item()
    torch.testing.assert_close(fast, reference, atol=2e-2 * scale, rtol=2e-2)


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_quantized_tower_runs_in_the_cpp_step_with_its_activation_quantization(hf, tmp_path, quantization,
                                                                               monkeypatch):
    """--quantization's tower: the fp32 scheme at every size, each projection on the step's kernel for its format
    (int8 / int4 with int8 activations: the VNNI tiles for GRIDS' 164 rows), within fp32 rounding of the
    reference (model/vision.py: its modules' fake-quantized rows times their dequantized weights). With int8
    activations the attention multiplies bf16 pairs (where the build has them): the reference's attention then
    rounds q, k and v to bf16 too."""
    llm = LLM(str(save_vision_checkpoint(hf, tmp_path / "ck")), quantization=quantization,
              enable_prefix_caching=False)
    visual = llm.engine.model.visual
    assert visual.blocks[0].mlp.linear_fc1.fmt.name == quantization
    tower = llm.engine.executor._vision
    ext = tower.ext
    assert tower.bf16_attention == (quantization != "fp8" and ext.BF16_PAIR_KERNEL)
    if tower.bf16_attention:
        monkeypatch.setattr(vision_model, "attend", attend_bf16)
    tiles = ext.vnni_tile_panels()
    fast, reference, seen = _encode(llm, _pixels(GRIDS, visual.config.patch_dim))
    assert seen.dtypes == [] and fast.dtype == torch.float32  # no torch product (the reference dequantizes)
    assert (ext.vnni_tile_panels() > tiles) == (quantization != "fp8" and ext.vnni_tiles_supported())
    # Where fp32 rounding (the LayerNorms' and GELU's sums, in other orders) moves an input value across an int8
    # rounding step, or a bf16 one in the attention, that value differs by the step: a few outputs move by more
    # than fp32 rounding (seed 5, relative RMS difference: int8 3.9e-4, int4 1.5e-3; the largest 3.4e-3 of the
    # scale). Without the activation quantization the tower would be 8.7e-3 - 9.1e-3 off (measured).
    rms = ((fast - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()).item()
    assert rms <= 3e-3
    _close(fast, reference, 1e-2)
