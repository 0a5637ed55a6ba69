"""The Qwen3.5 vision tower: patches of [temporal 2, 16, 16] pixels -> vision blocks with 2-D rotary -> the
2x2 spatial merger projecting to the text width. Parameter names and shapes are the official ones under
`model.visual.*` (transformers' Qwen3_5VisionModel), so the loader copies them one to one. The projections
(attention qkv / proj, MLP and merger fc1 / fc2) are model/linear.py's Linear with a bias: their weights are
stored once in the checkpoint's format (or --quantization's), like the text model's.

Patches arrive in the processor's order: per image, per frame, 2x2 merge blocks in raster order and the
four patches of a block together (deltaserve/engine/image_processor.py). Every row group of
spatial_merge_size**2 patches is therefore one merged token, and the merger is a reshape and an MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import VisionConfig
from deltaserve.model.linear import Linear

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}

Grid = tuple[int, int, int]  # (t, h, w) in patches


class PatchEmbed(nn.Module):
    """Conv3d with stride = kernel = [temporal, p, p]: over exactly one kernel per patch it is one matmul."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C * tp * p * p] -> [N, hidden]."""
        w = self.proj.weight  # [hidden, C, tp, p, p]: flattened in the patch's own (C, tp, p, p) order
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        """x [N, hidden]; each of `segments` (one frame of one image) attends within itself, unmasked."""
        N = x.shape[0]
        q, k, v = self.qkv(x).view(N, 3, self.num_heads, self.head_dim).unbind(1)  # each [N, heads, hd]
        return self.proj(attend(rotate(q, cos, sin), rotate(k, cos, sin), v, segments).reshape(N, -1))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[int]) -> torch.Tensor:
    """q, k, v [N, heads, hd] -> [N, heads, hd]: each of `segments` (consecutive rows) attends within itself."""
    outs, start = [], 0
    for n in segments:
        qs, ks, vs = (t[start : start + n].transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, n, hd]
        outs.append(F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1))
        start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def attend_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[int]) -> torch.Tensor:
    """attend() as bf16 dot products, the fused tower's bf16 scheme (and the reference of the C++ step's
    vision_attention_bf16): q, k, v [N, heads, hd] rounded to bf16 (the bf16 scheme's already are) -> q's dtype.
    The scores are the bf16 values' products summed in fp32, then scaled; the softmax's exponentials are fp32,
    rounded to bf16 to multiply v, and the fp32 sums are divided by the fp32 sum of the unrounded exponentials,
    then rounded once to bf16."""
    outs, start = [], 0
    scale = q.shape[-1] ** -0.5
    for n in segments:
        qs, ks, vs = (t[start : start + n].transpose(0, 1).bfloat16().float() for t in (q, k, v))  # [heads, n, hd]
        scores = (qs @ ks.transpose(1, 2)) * scale
        e = torch.exp(scores - scores.amax(-1, keepdim=True))
        o = (e.bfloat16().float() @ vs) / e.sum(-1, keepdim=True)
        outs.append(o.transpose(0, 1).bfloat16().to(q.dtype))
        start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary over the whole head, in fp32 (as transformers' apply_rotary_pos_emb_vision)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each merge block's patches side by side -> MLP (exact GELU) -> text width."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = Linear(self.merged, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.side = int(round(cfg.num_position_embeddings**0.5))
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        quarter = cfg.head_dim // 2
        # A plain attribute, not a buffer: it must stay fp32 when the model is cast to bf16; computed on the
        # CPU even while the loader builds the model's parameters on the meta device.
        steps = torch.arange(0, quarter, 2, dtype=torch.float32, device="cpu")
        self.inv_freq = 1.0 / (cfg.rope_theta ** (steps / quarter))

    @staticmethod
    def num_merged_tokens(grid: Grid, merge: int) -> int:
        t, h, w = grid
        return t * (h // merge) * (w // merge)

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """pixels [sum of t*h*w, patch_dim] for the images of `grids`, in the processor's patch order ->
        merged visual tokens [sum of t*h*w / merge**2, out_hidden_size], image after image."""
        x, cos, sin, segments = self.embed(pixels, grids)
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        return self.merger(x)

    def embed(self, pixels: torch.Tensor, grids: list[Grid]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      list[int]]:
        """What the blocks take: patch embeddings plus positions [N, hidden], the rotary's cos and sin, and the
        attention segments (one per frame of each image)."""
        self.check_pixels(pixels, grids)
        x = self.patch_embed(pixels)
        x = x + self.position_embeddings(grids).to(x.dtype)
        cos, sin = self.rotary(grids)
        return x, cos, sin, frame_segments(grids)

    def check_pixels(self, pixels: torch.Tensor, grids: list[Grid]) -> None:
        expected = sum(t * h * w for t, h, w in grids)
        if pixels.shape != (expected, self.config.patch_dim):
            raise ValueError(
                f"pixel values have shape {tuple(pixels.shape)}, expected ({expected}, {self.config.patch_dim}) "
                f"for grids {grids}"
            )

    def _merge_order(self, grid_values: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """A per-patch [h, w, ...] grid -> [h*w, ...] rows in merge-block order (block rows, block cols, m, m)."""
        m = self.config.spatial_merge_size
        rest = grid_values.shape[2:]
        return grid_values.reshape(h // m, m, w // m, m, *rest).transpose(1, 2).reshape(h * w, *rest)

    def position_embeddings(self, grids: list[Grid]) -> torch.Tensor:
        """The learned side x side grid resampled bilinearly (align_corners=True) to each image's h x w."""
        side = self.side
        table = self.pos_embed.weight.float().view(side, side, -1)
        out = []
        for t, h, w in grids:
            rows, cols = _bilinear_matrix(h, side), _bilinear_matrix(w, side)  # [h, side], [w, side]
            grid = torch.einsum("is,jr,srd->ijd", rows, cols, table)  # [h, w, hidden]
            out.append(self._merge_order(grid, h, w).repeat(t, 1))
        return torch.cat(out)

    def rotary(self, grids: list[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim]: a quarter of the frequencies read the patch row, a quarter its column."""
        pos = []
        for t, h, w in grids:
            hw = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), dim=-1)  # [h, w, 2]
            pos.append(self._merge_order(hw, h, w).repeat(t, 1))
        p = torch.cat(pos).float()  # [N, 2] (row, column)
        freqs = torch.cat([p[:, :1] * self.inv_freq, p[:, 1:] * self.inv_freq], dim=-1)  # [N, head_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def frame_segments(grids: list[Grid]) -> list[int]:
    """The attention segments of `grids`' patches: one per frame of each image, h * w rows each."""
    return [h * w for t, h, w in grids for _ in range(t)]


def _bilinear_matrix(size: int, side: int) -> torch.Tensor:
    """[size, side] weights that sample `side` table rows at linspace(0, side-1, size), linearly."""
    src = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    lo = src.floor().long().clamp(max=side - 1)
    hi = (lo + 1).clamp(max=side - 1)
    frac = src - lo.float()
    m = torch.zeros(size, side)
    rows = torch.arange(size)
    m[rows, lo] += 1 - frac
    m[rows, hi] += frac
    return m
