"""Causal depthwise conv1d with a carried state, as Gated DeltaNet applies it to q|k|v before SiLU.

The state of a sequence is its last K-1 pre-conv inputs, [C, K-1] (zeros for a fresh sequence: left zero
padding). weight is [C, K] (the checkpoint's [C, 1, K] squeezed). No bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_reference(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] -> out [T, C], new state [C, K-1]; one output at a time."""
    K = weight.shape[1]
    window = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [C, K-1+T]
    out = torch.stack([(window[:, t : t + K] * weight).sum(-1) for t in range(x.shape[0])])
    return out, window[:, -(K - 1) :].clone()


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] of one sequence -> out [T, C], new state [C, K-1]."""
    K = weight.shape[1]
    window = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [C, K-1+T]
    out = F.conv1d(window[None], weight[:, None, :].to(x.dtype), groups=weight.shape[0])[0]  # [C, T]
    return out.t(), window[:, -(K - 1) :].clone()


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token for B sequences: x [B, C], state [B, C, K-1] -> out [B, C], new state."""
    window = torch.cat([state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
    out = (window * weight.to(x.dtype)).sum(-1)
    return out, window[:, :, 1:]
