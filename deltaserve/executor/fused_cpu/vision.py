"""The fused executor's vision tower: model/vision.py's VisionTower (the reference; its modules and weights are
read where they are) with each projection whose weight is stored in bfloat16 run as bf16 dot products: its
input rounded to bf16, multiplied by the stored bf16 weight in torch's oneDNN kernels (AVX512-BF16 on this
CPU: 2-2.5x torch's fp32 matmul at the tower's shapes, and about 3x the C++ stack's packed kernels, which
widen the weights to fp32; measured 2026-12-01, docs/benchmarks.md "Vision vs transformers"), its output in
bf16. The residual stream, the LayerNorms and the rotary stay fp32, as in the reference; the attention and
the MLP's activation run in the projections' dtype.

Projections in any other format (float32, fp8, int8 / int4 with their activation quantization) run the
module's own forward, so an fp32 tower gives the reference's numbers exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.model.linear import Linear
from deltaserve.model.vision import Grid, PatchMerger, VisionBlock, VisionTower, attend, rotate


def project(module: Linear, x: torch.Tensor) -> torch.Tensor:
    """module(x) as the fast tower computes it: bf16 dot products (bf16 out) for a bf16-stored weight, else the
    module's forward on fp32 input (fp32 out)."""
    if module.fmt.name == "bfloat16":
        bias = None if module.bias is None else module.bias.to(torch.bfloat16)
        return F.linear(x.to(torch.bfloat16), module.weight, bias)
    return module(x.float())


def _block(block: VisionBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
           ) -> torch.Tensor:
    """VisionBlock.forward with `project`'s products; x (the residual stream) stays fp32."""
    a, mlp = block.attn, block.mlp
    N = x.shape[0]
    q, k, v = project(a.qkv, block.norm1(x)).view(N, 3, a.num_heads, a.head_dim).unbind(1)
    attended = attend(rotate(q, cos, sin), rotate(k, cos, sin), v, segments)
    x = x + project(a.proj, attended.reshape(N, -1)).float()
    return x + project(mlp.linear_fc2, mlp.act(project(mlp.linear_fc1, block.norm2(x)))).float()


def _merge(merger: PatchMerger, x: torch.Tensor) -> torch.Tensor:
    """PatchMerger.forward with `project`'s products; fp32 out."""
    merged = merger.norm(x).view(-1, merger.merged)
    return project(merger.linear_fc2, F.gelu(project(merger.linear_fc1, merged))).float()


def encode_images(tower: VisionTower, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
    """VisionTower.forward(pixels, grids), with bf16-stored projections as bf16 dot products."""
    x, cos, sin, segments = tower.embed(pixels, grids)
    for block in tower.blocks:
        x = _block(block, x, cos, sin, segments)
    return _merge(tower.merger, x)
