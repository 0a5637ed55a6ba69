"""Building blocks shared by the mixers: the two RMSNorms and (partial, multimodal) rotary embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32; w starts at 0."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel: one op instead of five on the per-token hot path (same result in fp32).
        scale = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), scale.shape, scale, self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The norm inside Gated DeltaNet: plain weight (starts at 1), then multiplied by silu(gate)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * torch.nn.functional.silu(gate.float())).to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half (NeoX) rotary embedding on the first `rotary_dim` dims of each head.

    Positions are [T] for text or [3, T] (t, h, w) for multimodal RoPE: with mrope_section [s_t, s_h, s_w]
    and interleaving, frequency f takes the h position if f % 3 == 1 and f < 3*s_h, the w position if
    f % 3 == 2 and f < 3*s_w, else the t position. For text the three rows are equal (plain RoPE)."""

    def __init__(
        self, rotary_dim: int, theta: float, mrope_section: list[int] | None = None, interleaved: bool = True
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        # Computed on the CPU even while the loader builds the parameters on the meta device.
        steps = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu")
        inv_freq = 1.0 / (theta ** (steps / rotary_dim))
        # A plain attribute, not a buffer: it must stay fp32 when the model is cast to bf16.
        self.inv_freq = inv_freq
        half = rotary_dim // 2
        axis = torch.zeros(half, dtype=torch.long, device="cpu")  # which position row each frequency reads
        if mrope_section is not None:
            f = torch.arange(half, device="cpu")
            if interleaved:
                axis[(f % 3 == 1) & (f < 3 * mrope_section[1])] = 1
                axis[(f % 3 == 2) & (f < 3 * mrope_section[2])] = 2
            else:
                axis[mrope_section[0] : mrope_section[0] + mrope_section[1]] = 1
                axis[mrope_section[0] + mrope_section[1] :] = 2
        self.register_buffer("axis", axis, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] or [3, T] -> cos, sin [T, rotary_dim] in fp32."""
        if positions.dim() == 1:
            freqs = positions.float()[:, None] * self.inv_freq  # [T, half]
        else:
            pos = positions.float()[self.axis]  # [half, T]: the row each frequency reads
            freqs = pos.t() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim]; rotates x[..., :rotary_dim], leaves the rest."""
        r = self.rotary_dim
        rot, rest = x[..., :r].float(), x[..., r:]
        half = r // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        rot = rot * cos[:, None, :] + rotated * sin[:, None, :]
        return torch.cat([rot.to(x.dtype), rest], dim=-1)
