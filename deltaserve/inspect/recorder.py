"""TraceRecorder: what the model hands the inspector during one traced forward (ForwardTrace protocol).

Per layer it keeps only small summaries (norms, a few coordinates), so tracing a long prompt through a
deep model stays cheap; the mixer internals (q, k, v, g, beta, gate) are kept only for the layers asked
for, since the GDN and attention labs need them whole."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(slots=True)
class LayerSummary:
    layer_id: int
    x_in_norm: torch.Tensor  # [T] ‖X_in‖ per token
    mix_norm: torch.Tensor  # [T] ‖Δmix‖
    ffn_norm: torch.Tensor  # [T] ‖Δffn‖
    x_out_norm: torch.Tensor  # [T] ‖X_out‖
    x_in: torch.Tensor  # [T, C] the chosen coordinates
    mix: torch.Tensor  # [T, C]
    ffn: torch.Tensor  # [T, C]
    x_out: torch.Tensor  # [T, C]
    residual_error: float  # max |X_out - (X_in + Δmix + Δffn)| as the model summed it
    handoff_error: float  # max |X_in - X_out of the previous layer| (0 for the first layer)


@dataclass(slots=True)
class GDNCapture:
    mixer: nn.Module
    qkv: torch.Tensor  # [T, conv_dim] before the causal conv
    z: torch.Tensor  # [T, Hv, dv] output gate input
    g: torch.Tensor  # [T, Hv] log-decay (fp32)
    beta: torch.Tensor  # [T, Hv] write strength (fp32)


@dataclass(slots=True)
class AttentionCapture:
    mixer: nn.Module
    q: torch.Tensor  # [T, nh, hd] after q_norm and RoPE
    k: torch.Tensor  # [T, nkv, hd] after k_norm and RoPE
    v: torch.Tensor  # [T, nkv, hd]
    gate: torch.Tensor  # [T, nh, hd] before the sigmoid


@dataclass(slots=True)
class TraceRecorder:
    coords: list[int]
    capture: set[int] = field(default_factory=set)  # layer ids whose mixer internals are kept
    layers: list[LayerSummary] = field(default_factory=list)
    gdn_layers: dict[int, GDNCapture] = field(default_factory=dict)
    attention_layers: dict[int, AttentionCapture] = field(default_factory=dict)
    last_out: torch.Tensor | None = None  # [T, H] X_out of the latest layer

    def layer(self, layer_id: int, x: torch.Tensor, mix: torch.Tensor, ffn: torch.Tensor) -> None:
        out = (x + mix) + ffn  # the model's own order of additions, so the next layer's X_in matches bitwise
        idx = torch.tensor(self.coords, dtype=torch.long)
        f = lambda t: t.detach().float()  # noqa: E731
        handoff = 0.0 if self.last_out is None else float((x - self.last_out).abs().max())
        self.layers.append(
            LayerSummary(
                layer_id=layer_id,
                x_in_norm=f(x).norm(dim=-1), mix_norm=f(mix).norm(dim=-1),
                ffn_norm=f(ffn).norm(dim=-1), x_out_norm=f(out).norm(dim=-1),
                x_in=f(x)[:, idx], mix=f(mix)[:, idx], ffn=f(ffn)[:, idx], x_out=f(out)[:, idx],
                residual_error=float((f(out) - (f(x) + f(mix) + f(ffn))).abs().max()),
                handoff_error=handoff,
            )
        )
        self.last_out = out.detach()

    def gdn(self, mixer: nn.Module, qkv: torch.Tensor, z: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor) -> None:
        if mixer.layer_id in self.capture:
            self.gdn_layers[mixer.layer_id] = GDNCapture(mixer, qkv.detach(), z.detach(), g.detach(),
                                                         beta.detach())

    def attention(self, mixer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  gate: torch.Tensor) -> None:
        if mixer.layer_id in self.capture:
            self.attention_layers[mixer.layer_id] = AttentionCapture(
                mixer, q.detach(), k.detach(), v.detach(), gate.detach()
            )
