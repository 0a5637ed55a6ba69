"""Gated DeltaNet mixer: projections, causal conv on q|k|v, the gated delta rule, gated RMSNorm, out_proj.

Prompt chunks run the chunked rule per sequence; single decode tokens of all sequences run one batched
recurrent step. States live in the cache's slots: conv [conv_dim, K-1] and recurrent [Hv, dk, dv] fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.model.context import ForwardContext
from deltaserve.model.layers import GatedRMSNorm
from deltaserve.model.linear import Linear, shared_activations
from deltaserve.model.parallel import SINGLE, Shard
from deltaserve.ops.conv import causal_conv1d, causal_conv1d_step
from deltaserve.ops.delta_rule import delta_rule_chunked, delta_rule_recurrent, delta_rule_step


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, shard: Shard = SINGLE) -> None:
        """cfg: this rank's key/value heads (rank_config); out_proj's partial sums meet in shard."""
        super().__init__()
        self.layer_id = layer_id
        self.shard = shard
        self.num_k_heads = cfg.linear_num_key_heads
        self.num_v_heads = cfg.linear_num_value_heads
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        self.key_dim = cfg.linear_key_dim
        self.value_dim = cfg.linear_value_dim
        self.conv_dim = cfg.conv_dim
        self.kernel_size = cfg.linear_conv_kernel_dim
        H = cfg.hidden_size
        self.in_proj_qkv = Linear(H, self.conv_dim)
        self.in_proj_z = Linear(H, self.value_dim)
        self.in_proj_b = Linear(H, self.num_v_heads)
        self.in_proj_a = Linear(H, self.num_v_heads)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        # log U(0.01, 16), as transformers initialises it; not on the meta device, where the loader builds the
        # model (shapes only): torch's log there imports torch._dynamo, 72 MB resident and a second of start-up.
        a = torch.empty(self.num_v_heads).uniform_(0.01, 16)
        self.A_log = nn.Parameter(a if a.is_meta else a.log())
        self.norm = GatedRMSNorm(self.head_v_dim, eps=cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, H)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        x_qkv, x_z, x_b, x_a = shared_activations(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        qkv = self.in_proj_qkv(x, x_qkv)  # [T, conv_dim]
        z = self.in_proj_z(x, x_z).view(T, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(x, x_b).float().sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x, x_a).float() + self.dt_bias.float())
        weight = self.conv1d.weight[:, 0, :]  # [conv_dim, K]
        if ctx.trace is not None:
            ctx.trace.gdn(self, qkv, z, g, beta)

        if ctx.cache is None:
            core = self._stateless(qkv, g, beta, weight, ctx)
        else:
            core = self._cached(qkv, g, beta, weight, ctx)
        out = self.norm(core.to(x.dtype), z).reshape(T, self.value_dim)
        return self.shard.all_reduce(self.out_proj(out))

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-conv q|k|v [..., conv_dim] -> q, k [..., Hv, dk] (normalised, q scaled), v [..., Hv, dv]."""
        lead = mixed.shape[:-1]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(*lead, self.num_k_heads, self.head_k_dim).float()) * self.head_k_dim**-0.5
        k = l2norm(k.reshape(*lead, self.num_k_heads, self.head_k_dim).float())
        rep = self.num_v_heads // self.num_k_heads
        if rep > 1:
            q = q.repeat_interleave(rep, dim=-2)
            k = k.repeat_interleave(rep, dim=-2)
        return q, k, v.reshape(*lead, self.num_v_heads, self.head_v_dim).float()

    def _stateless(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        T = qkv.shape[0]
        if ctx.uniform_len:
            # B equal sequences: batch the conv over B and fold B into the head axis of the delta rule.
            L = ctx.uniform_len
            B = T // L
            pad = self.kernel_size - 1
            mixed = F.conv1d(
                F.pad(qkv.view(B, L, -1).transpose(1, 2), (pad, 0)), weight[:, None, :], groups=self.conv_dim
            )
            q, k, v = self._split_heads(F.silu(mixed).transpose(1, 2))  # [B, L, Hv, d]
            fold = lambda t: t.transpose(0, 1).reshape(L, B * self.num_v_heads, *t.shape[3:])  # noqa: E731
            o, _ = delta_rule_chunked(fold(q), fold(k), fold(v), fold(g.view(B, L, -1)), fold(beta.view(B, L, -1)))
            return o.view(L, B, self.num_v_heads, self.head_v_dim).transpose(0, 1).reshape(T, self.num_v_heads, -1)
        outs = []
        zero_conv = qkv.new_zeros(self.conv_dim, self.kernel_size - 1)
        for b in range(ctx.num_seqs):
            s, e = ctx.query_start_loc[b], ctx.query_start_loc[b + 1]
            mixed, _ = causal_conv1d(qkv[s:e], weight, zero_conv)
            q, k, v = self._split_heads(F.silu(mixed))
            outs.append(delta_rule_chunked(q, k, v, g[s:e], beta[s:e])[0])
        return torch.cat(outs)

    def _cached(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        conv_cache = ctx.cache.conv[self.layer_id]
        ssm_cache = ctx.cache.ssm[self.layer_id]
        T = qkv.shape[0]
        core = qkv.new_empty(T, self.num_v_heads, self.head_v_dim, dtype=torch.float32)
        if ctx.decode_seqs:
            idx, slots, keep = ctx.decode.tokens, ctx.decode.slots, ctx.decode.keep
            conv_state = conv_cache[slots] * keep.to(conv_cache.dtype)[:, None, None]
            mixed, conv_state = causal_conv1d_step(qkv[idx], weight, conv_state)
            conv_cache[slots] = conv_state.to(conv_cache.dtype)
            q, k, v = self._split_heads(F.silu(mixed))
            state = ssm_cache[slots].float() * keep[:, None, None, None]
            o, state = delta_rule_step(q, k, v, g[idx], beta[idx], state)
            ssm_cache[slots] = state.to(ssm_cache.dtype)
            core[idx] = o
        if ctx.spec_seqs:
            self._verify(qkv, g, beta, weight, ctx, core)
        for b in ctx.prefill_seqs:
            s, e = ctx.query_start_loc[b], ctx.query_start_loc[b + 1]
            slot = int(ctx.state_slots[b])
            fresh = ctx.context_lens[b] == 0
            conv_state = torch.zeros_like(conv_cache[slot]) if fresh else conv_cache[slot]
            mixed, conv_state = causal_conv1d(qkv[s:e], weight, conv_state)
            conv_cache[slot] = conv_state.to(conv_cache.dtype)
            q, k, v = self._split_heads(F.silu(mixed))
            o, state = delta_rule_chunked(q, k, v, g[s:e], beta[s:e], None if fresh else ssm_cache[slot])
            ssm_cache[slot] = state.to(ssm_cache.dtype)
            core[s:e] = o
        return core

    def _verify(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor,
        ctx: ForwardContext, core: torch.Tensor,
    ) -> None:
        """Speculative verify segments, batched as [S, L]: outputs go to `core`; the conv and recurrent
        states after every position go to ctx.spec_states and the slots stay untouched until the engine
        commits the state of the last accepted position. Padding positions get g = 0 and beta = 0, which
        leave the state unchanged, and their outputs are never read."""
        idx, valid = ctx.spec_tokens, ctx.spec_valid  # [S, L]
        slots = ctx.state_slots[ctx.spec_seqs]
        K = self.kernel_size
        x = qkv[idx].transpose(1, 2)  # [S, conv_dim, L]
        window = torch.cat([ctx.cache.conv[self.layer_id][slots].to(x.dtype), x], dim=2)  # [S, C, K-1+L]
        # A few positions: multiply-and-sum over the K taps beats F.conv1d's per-call setup by far.
        mixed = (window.unfold(2, K, 1) * weight[:, None, :].to(x.dtype)).sum(-1)  # [S, C, L]
        # The conv state after position i is the window's K-1 columns ending at input i.
        conv_states = window.unfold(2, K - 1, 1)[:, :, 1:].transpose(1, 2)  # [S, L, C, K-1]
        q, k, v = self._split_heads(F.silu(mixed.transpose(1, 2)))  # [S, L, Hv, d]
        mask = valid.float()[..., None]
        state = ctx.cache.ssm[self.layer_id][slots].float()
        o, states = delta_rule_recurrent(q, k, v, g[idx] * mask, beta[idx] * mask, state)
        core[idx[valid]] = o[valid]
        ctx.spec_states[self.layer_id] = (conv_states, states)
