"""The fused executor's vision tower: model/vision.py's VisionTower (the reference; its modules and weights are
read where they are) with each projection whose weight is stored in bfloat16 run as bf16 dot products: its
input rounded to bf16, multiplied by the stored bf16 weight in torch's oneDNN kernels (AVX512-BF16, or AMX
where the CPU has it), its output in bf16. The bf16 scheme, for a large call of a tower whose projections are
all stored in bf16 (as the released checkpoints are; a small call runs the fp32 scheme below):
- the patch embedding is one bf16 matmul too: pixels rounded to bf16, times a bf16 copy of its weight (exact
  where the checkpoint stores it in bf16, as the released ones do; else rounded once, as the projections are);
- each projection's bias is added in the product in bf16, from a copy cast once (not on every call);
- the residual stream stays fp32, and LayerNorm, rotary and the MLP's activation compute in fp32, as in the
  reference; what they produce is a projection's input (or the attention's), rounded once to bf16;
- the attention multiplies bf16 values too, its softmax in fp32 (model/vision.py attend_bf16; the C++ step's
  vision_attention_bf16 where the CPU has AVX512-BF16, else torch's bf16 SDPA).
The element-wise steps between the products run in the C++ step's kernels (ops/csrc/vision.h), one pass each
over bf16 in / out: the residual add fused with the next LayerNorm, q and k rotated in place in the qkv
product, the tanh GELU in place. torch's mixed-dtype ops made a converted copy of each operand, and its tanh
GELU took longer than the fc1 product on an AMX CPU (together about a quarter of the tower, measured
2026-12-02).

A small call of such a tower (at most SMALL_CALL_VALUES patch values: rows x hidden) runs the fp32 scheme
instead: the blocks and the merger whole in the C++ step (ops/csrc/vision.h vision_block_f32 and
vision_merger_f32, one call each), the residual stream, every product's input and output in fp32, each
projection's stored weight read where it is by the step's own linear kernels (ops/csrc/linear.h) and widened in
registers, the biases and LayerNorms as stored (fp32), and the patch embedding the same kernel on the stored
conv weight. Its numbers are the reference's fp32 ones (model/vision.py on fp32 input) up to the order of the
sums. The reason is time, not accuracy: a product of the demo's tower (64 patches, width 128) cost torch's
oneDNN bf16 kernel 40-110 us, little related to its size, and with the torch ops between them a call took
2.3-2.6 ms, where the fp32 scheme takes 1.4-2.0 (2 and 1 threads, an AMD EPYC; docs/benchmarks.md, "Vision vs
transformers, the demo: small calls in fp32"). From larger calls on (about 144 rows at width 128, 21-36 at width
768, 1 thread), the bf16 products' twice-as-fast arithmetic wins.

A tower whose projections are stored in any other format (float32, fp8, int8 / int4, or a mix) runs the fp32
scheme at every size, each projection as its module computes: int8 / int4 weights with their activation
quantization (ops/activation_quant.py, the step's integer kernels: the VNNI tiles for a call's many rows),
the others on fp32 rows. Its numbers are the reference's up to the order of the sums, but for one thing: where
the projections quantize their input rows to int8, the blocks' attention multiplies bf16 pairs (the bf16
scheme's kernel, on q, k and v rounded to bf16; AVX512-BF16 builds), as llama.cpp multiplies q and k with an
f16 KV cache under its quantized weights. bf16 keeps 8 bits of each value, finer than a row's int8 step (a
128th of its group's largest); at the 0.8B tower's 784 patches it halves the attention, a third of the tower.
(The tower ran the modules' own forwards in torch until 2026-12-07, each dequantizing its whole weight per
call: an int8 0.8B tower took 2.5x the bf16 one's time.)

A frame size's position embeddings and rotary tables (the same numbers every time: a bilinear resampling of
the learned grid and the cos / sin of its positions) are kept for the last few sizes seen."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.model.linear import Linear
from deltaserve.model.vision import Grid, VisionBlock, VisionTower, attend, frame_segments
from deltaserve.ops.activation_quant import reads_int8_activations
from deltaserve.ops.fused_ext import load_extension

KEPT_FRAME_SIZES = 4  # frame sizes (h, w) whose position embeddings and rotary tables are kept
# A bf16 tower's calls of at most this many patch values (rows x hidden) run the fp32 scheme (the docstring).
SMALL_CALL_VALUES = 128 * 128
# The conv weight's dtypes the step's linear kernels read (the patch embedding of the fp32 scheme).
_FORMAT_OF_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

# The MLP activations that have an in-place form (the product's fresh output is overwritten, not copied).
_IN_PLACE = {
    "gelu_pytorch_tanh": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "gelu": torch.ops.aten.gelu_,
    "silu": torch.ops.aten.silu_,
}


class Projection:
    """One bf16-stored Linear as the bf16 scheme multiplies: bf16 dot products, bf16 out, the bias cast to bf16
    once."""

    __slots__ = ("weight", "bias")

    def __init__(self, module: Linear) -> None:
        self.weight = module.weight
        self.bias = None if module.bias is None else module.bias.detach().to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight, self.bias)


@dataclass(slots=True)
class Tables:
    """What the blocks read about the patches' positions, for a list of grids."""

    pos: torch.Tensor  # [N, hidden] fp32: the position embeddings, added to the patch embeddings
    cos: torch.Tensor  # [N, head_dim] fp32
    sin: torch.Tensor  # [N, head_dim] fp32

    @staticmethod
    def cat(parts: list[Tables]) -> Tables:
        if len(parts) == 1:
            return parts[0]
        return Tables(*(torch.cat([getattr(p, f) for p in parts]) for f in ("pos", "cos", "sin")))


def _fp32_norm(norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(weight, bias, eps) as add_layer_norm_bf16 takes them: contiguous fp32 copies."""
    return norm.weight.detach().float().contiguous(), norm.bias.detach().float().contiguous(), float(norm.eps)


def _fp32_bias(module: Linear | nn.Module) -> torch.Tensor:
    """A projection's bias as the fp32 scheme adds it: the stored tensor itself when it is fp32 (as the loader
    keeps it), else an fp32 copy of its few values."""
    return module.bias.detach().float().contiguous()


def _fp32_projection(module: Linear) -> tuple:
    """(part, bias, activation quantization) as ext.vision_block_f32 takes a projection: its stored weight as the
    step's linear kernels read it ((data, scale or None, format name, group)), its fp32 bias, and "int8" where
    the module quantizes its input rows (activation_quant.py: int8 / int4 weights), else "none"."""
    fmt = module.fmt
    scale = module.scale("weight")
    part = (module.weight.detach(), None if scale is None else scale.detach(), fmt.name, fmt.group or 0)
    int8 = reads_int8_activations(module.activation_quantization, fmt)
    return part, _fp32_bias(module), "int8" if int8 else "none"


class FastVisionTower:
    """VisionTower.forward(pixels, grids) with the scheme above. Made once per engine: the bf16 copies of the
    biases and the patch embedding's weight, and fp32 copies of the LayerNorms' (for the kernels), are taken
    here (the tower's weights do not change under a running engine)."""

    def __init__(self, tower: VisionTower, ext: ModuleType | None = None) -> None:
        """ext: the C++ step's module; loaded here when not given."""
        self.tower = tower
        self.ext = ext or load_extension()
        self.norms = [(_fp32_norm(block.norm1), _fp32_norm(block.norm2)) for block in tower.blocks]
        self.merger_norm = _fp32_norm(tower.merger.norm)
        self._fp32_scheme(tower)
        merger = tower.merger
        projections = [m for b in tower.blocks for m in (b.attn.qkv, b.attn.proj, b.mlp.linear_fc1, b.mlp.linear_fc2)]
        # the bf16 scheme for a large call, patch embedding included
        self.bf16 = all(m.fmt.name == "bfloat16" for m in [*projections, merger.linear_fc1, merger.linear_fc2])
        # int8-activation projections: the fp32 scheme's attention as bf16 pairs (the docstring)
        self.bf16_attention = self.ext.BF16_PAIR_KERNEL and any(
            reads_int8_activations(m.activation_quantization, m.fmt) for m in projections)
        if self.bf16:
            self.blocks = [
                (block, Projection(block.attn.qkv), Projection(block.attn.proj), Projection(block.mlp.linear_fc1),
                 Projection(block.mlp.linear_fc2))
                for block in tower.blocks
            ]
            self.merger_fc1, self.merger_fc2 = Projection(merger.linear_fc1), Projection(merger.linear_fc2)
            self.act_ = _IN_PLACE.get(tower.config.hidden_act)
            if tower.config.hidden_act == "gelu_pytorch_tanh":
                self.act_ = self.ext.gelu_tanh_bf16_
            conv = tower.patch_embed.proj
            # [hidden, patch_dim] in the patch's own (C, tp, p, p) order, as PatchEmbed multiplies it
            self.patch_weight = conv.weight.detach().reshape(conv.weight.shape[0], -1).to(torch.bfloat16)
            self.patch_bias = None if conv.bias is None else conv.bias.detach().to(torch.bfloat16)
        self._tables: OrderedDict[tuple[int, int], Tables] = OrderedDict()

    def _fp32_scheme(self, tower: VisionTower) -> None:
        """What the fp32 scheme passes the C++ step: the model's own tensors (the norms' fp32 weights as the
        bf16 scheme's kernels take them; an fp32 copy only of a bias or conv weight stored in another dtype)."""
        act = tower.config.hidden_act
        self.fp32_blocks = [
            (norm1, _fp32_projection(block.attn.qkv), _fp32_projection(block.attn.proj), norm2,
             _fp32_projection(block.mlp.linear_fc1), _fp32_projection(block.mlp.linear_fc2), block.attn.num_heads,
             act)
            for block, (norm1, norm2) in zip(tower.blocks, self.norms, strict=True)
        ]
        merger = tower.merger
        self.fp32_merger = (self.merger_norm, merger.merged, _fp32_projection(merger.linear_fc1),
                            _fp32_projection(merger.linear_fc2))
        conv = tower.patch_embed.proj
        weight = conv.weight.detach()
        if weight.dtype not in _FORMAT_OF_DTYPE:
            weight = weight.float()
        # [hidden, patch_dim]: a view of the conv's weight, in the patch's own (C, tp, p, p) order
        self.fp32_patch = [(weight.reshape(weight.shape[0], -1), None, _FORMAT_OF_DTYPE[weight.dtype], 0)]
        self.fp32_patch_bias = None if conv.bias is None else _fp32_bias(conv)

    def __call__(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        tower = self.tower
        tower.check_pixels(pixels, grids)
        tables = Tables.cat([self._frame_tables(h, w) for t, h, w in grids for _ in range(t)])
        segments = frame_segments(grids)
        if self.bf16 and pixels.shape[0] * tower.config.hidden_size > SMALL_CALL_VALUES:
            patches = F.linear(pixels.to(torch.bfloat16), self.patch_weight, self.patch_bias)
            return self._bf16_tower((patches + tables.pos).contiguous(), tables, segments)
        return self._fp32_tower(pixels, tables, segments)

    def _fp32_tower(self, pixels: torch.Tensor, tables: Tables, segments: list[int]) -> torch.Tensor:
        """The fp32 scheme: the patch embedding on the step's linear kernel, then each block and the merger in
        one C++ call each; fp32 out."""
        ext = self.ext
        x = ext.linear(pixels.float().contiguous(), self.fp32_patch)  # [N, hidden]: fresh, the blocks add in place
        if self.fp32_patch_bias is not None:
            x.add_(self.fp32_patch_bias)
        x.add_(tables.pos)
        for block in self.fp32_blocks:
            ext.vision_block_f32(x, *block, tables.cos, tables.sin, segments, bf16_attention=self.bf16_attention)
        return ext.vision_merger_f32(x, *self.fp32_merger)

    def _frame_tables(self, h: int, w: int) -> Tables:
        """One frame's tables (the reference's position_embeddings and rotary for an (1, h, w) grid)."""
        key = (h, w)
        if key in self._tables:
            self._tables.move_to_end(key)
            return self._tables[key]
        pos = self.tower.position_embeddings([(1, h, w)])
        cos, sin = self.tower.rotary([(1, h, w)])
        tables = Tables(pos, cos.contiguous(), sin.contiguous())
        self._tables[key] = tables
        if len(self._tables) > KEPT_FRAME_SIZES:
            self._tables.popitem(last=False)
        return tables

    def _activate_(self, block: VisionBlock, hidden: torch.Tensor) -> torch.Tensor:
        """The MLP's activation of the fc1 product, in place where it has an in-place form."""
        if self.act_ is None:
            return block.mlp.act(hidden)
        self.act_(hidden)
        return hidden

    def _bf16_tower(self, x: torch.Tensor, tables: Tables, segments: list[int]) -> torch.Tensor:
        """The blocks and the merger on bf16 products. x: the residual stream [N, hidden] fp32, added to in
        place; each block's last product is added with the next LayerNorm (the kernel's y)."""
        ext = self.ext
        pending = None
        for (block, qkv, proj, fc1, fc2), (norm1, norm2) in zip(self.blocks, self.norms, strict=True):
            a = block.attn
            N = x.shape[0]
            qkv_out = qkv(ext.add_layer_norm_bf16(x, pending, *norm1)).view(N, 3, a.num_heads, a.head_dim)
            ext.rotary_qk_bf16_(qkv_out, tables.cos, tables.sin)
            attended = proj(self._attend_bf16(qkv_out, segments))
            hidden = self._activate_(block, fc1(ext.add_layer_norm_bf16(x, attended, *norm2)))
            pending = fc2(hidden)
        merger = self.tower.merger
        return self._merger_products(ext.add_layer_norm_bf16(x, pending, *self.merger_norm).view(-1, merger.merged))

    def _attend_bf16(self, qkv: torch.Tensor, segments: list[int]) -> torch.Tensor:
        """The attention of the bf16 scheme: qkv [N, 3, heads, hd] bf16 -> [N, heads * hd] bf16. The C++ step's
        kernel where the build multiplies bf16 pairs (model/vision.py attend_bf16's numbers, 2.0-2.1x torch's
        bf16 SDPA at the 0.8B tower's 784 patches, 1 and 2 threads), else torch's SDPA in bf16."""
        if self.ext.BF16_PAIR_KERNEL:
            return self.ext.vision_attention_bf16(qkv, segments)
        return attend(*qkv.unbind(1), segments).reshape(qkv.shape[0], -1)

    def _merger_products(self, merged: torch.Tensor) -> torch.Tensor:
        """The merger's fc1, GELU (in place) and fc2 on its normed, merged rows; fp32 out."""
        return self.merger_fc2(torch.ops.aten.gelu_(self.merger_fc1(merged))).float()
