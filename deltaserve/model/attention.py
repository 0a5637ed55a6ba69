"""Gated grouped-query attention: q_proj yields query and output gate per head; q/k RMSNorm before partial
RoPE; K/V written to the paged cache; output o_proj(attn * sigmoid(gate))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.model.context import ForwardContext
from deltaserve.model.layers import RMSNorm, RotaryEmbedding
from deltaserve.model.linear import Linear, shared_activations
from deltaserve.model.parallel import SINGLE, Shard
from deltaserve.ops.attention import decode_attention, prefill_attention, write_kv


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, shard: Shard = SINGLE) -> None:
        """cfg: this rank's heads (model/sharding.py rank_config); o_proj's partial sums meet in shard."""
        super().__init__()
        self.layer_id = layer_id
        self.shard = shard
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        H = cfg.hidden_size
        self.q_proj = Linear(H, self.num_heads * self.head_dim * 2)
        self.k_proj = Linear(H, self.num_kv_heads * self.head_dim)
        self.v_proj = Linear(H, self.num_kv_heads * self.head_dim)
        self.o_proj = Linear(self.num_heads * self.head_dim, H)
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, ctx: ForwardContext, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        T = x.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        # Per head: the first hd outputs are the query, the next hd the gate.
        xq, xk, xv = shared_activations(x, self.q_proj, self.k_proj, self.v_proj)
        q, gate = self.q_proj(x, xq).view(T, nh, 2 * hd).split(hd, dim=-1)
        q = rope(self.q_norm(q), cos, sin)
        k = rope(self.k_norm(self.k_proj(x, xk).view(T, nkv, hd)), cos, sin)
        v = self.v_proj(x, xv).view(T, nkv, hd)
        if ctx.trace is not None:
            ctx.trace.attention(self, q, k, v, gate)
        out = self._attend(q, k, v, ctx)  # [T, nh, hd]
        out = out.reshape(T, nh * hd) * torch.sigmoid(gate.reshape(T, nh * hd))
        return self.shard.all_reduce(self.o_proj(out))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if ctx.cache is None:
            if ctx.uniform_len:
                L = ctx.uniform_len
                B = q.shape[0] // L
                view = lambda t: t.view(B, L, *t.shape[1:]).transpose(1, 2)  # noqa: E731
                out = F.scaled_dot_product_attention(
                    view(q), view(k), view(v), is_causal=True, scale=self.scale, enable_gqa=True
                )
                return out.transpose(1, 2).reshape(q.shape)
            outs = []
            for b in range(ctx.num_seqs):
                rows = slice(ctx.query_start_loc[b], ctx.query_start_loc[b + 1])
                qs, ks, vs = (t[rows].transpose(0, 1)[None] for t in (q, k, v))  # 4-D: the fused kernel
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True)
                outs.append(out[0].transpose(0, 1))
            return torch.cat(outs)

        k_cache, v_cache = ctx.cache.kv[self.layer_id]
        scales = ctx.cache.kv_scales.get(self.layer_id)  # an fp8 cache's per-row scales (ops/attention.py)
        write_kv(k_cache, v_cache, ctx.slot_mapping, k, v, scales)
        out = torch.empty_like(q)
        if ctx.decode_seqs:
            d = ctx.decode
            out[d.tokens] = decode_attention(
                q[d.tokens], k_cache, v_cache, d.block_tables, d.seq_lens, self.scale, scales
            )
        for b in ctx.prefill_seqs + ctx.spec_seqs:  # a verify segment attends like a short chunk
            s, e = ctx.query_start_loc[b], ctx.query_start_loc[b + 1]
            out[s:e] = prefill_attention(
                q[s:e], k_cache, v_cache, ctx.block_tables[b], ctx.seq_lens[b], self.scale, scales
            )
        return out
