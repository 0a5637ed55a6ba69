"""Causal grouped-query attention over a paged KV cache.

Cache layout per attention layer: v_cache [num_blocks, block_size, nkv, hd] and, transposed within each
block, k_cache [num_blocks, nkv, hd, block_size]: a block's keys of one head and one dim are contiguous,
so the fused step scores a query against a whole block with vector FMAs (no per-key horizontal sums). A
sequence owns the blocks listed in its block table; its token at position p lives in block
table[p // block_size], at offset p % block_size. Query head h reads kv head h // (nh / nkv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kv_cache_shapes(num_blocks: int, block_size: int, nkv: int, hd: int) -> tuple[tuple, tuple]:
    """Shapes of k_cache and v_cache (see the module docstring)."""
    return (num_blocks, nkv, hd, block_size), (num_blocks, block_size, nkv, hd)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store k, v [T, nkv, hd] at flat slots [T] (block * block_size + offset)."""
    block_size, nkv, hd = v_cache.shape[1:]
    v_cache.view(-1, nkv, hd).index_copy_(0, slots, v.to(v_cache.dtype))
    k_cache[slots // block_size, :, :, slots % block_size] = k.to(k_cache.dtype)


def gather_keys(k_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached keys of one sequence, [length, nkv, hd]."""
    block_size = k_cache.shape[-1]
    blocks = block_table[: (length + block_size - 1) // block_size]
    return k_cache[blocks].permute(0, 3, 1, 2).flatten(0, 1)[:length]


def gather_values(v_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached values of one sequence, [length, nkv, hd]."""
    block_size = v_cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size]
    return v_cache[blocks].flatten(0, 1)[:length]


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Plain softmax attention: q [Tq, nh, hd] are the last Tq of the L positions in k, v [L, nkv, hd]."""
    Tq, nh, _ = q.shape
    L, nkv, _ = k.shape
    rep = nh // nkv
    k = k.repeat_interleave(rep, dim=1).float()
    v = v.repeat_interleave(rep, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    allowed = torch.arange(L)[None, :] <= torch.arange(L - Tq, L)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_len: int, scale: float,
) -> torch.Tensor:
    """One sequence: q [Tq, nh, hd] for positions seq_len-Tq .. seq_len-1, whose K/V are already written."""
    Tq = q.shape[0]
    # A leading batch dim matters: 4-D inputs take torch's fused CPU kernel, 3-D ones the slow math path.
    k = gather_keys(k_cache, block_table, seq_len).transpose(0, 1)[None]  # [1, nkv, L, hd]
    v = gather_values(v_cache, block_table, seq_len).transpose(0, 1)[None]
    qh = q.transpose(0, 1)[None]  # [1, nh, Tq, hd]
    if Tq == seq_len:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        allowed = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - Tq, seq_len)[:, None]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """B sequences with one query each: q [B, nh, hd], block_tables [B, nb] (padded), seq_lens [B]."""
    B = q.shape[0]
    block_size = v_cache.shape[1]
    max_len = int(seq_lens.max())
    nb = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :nb]
    k = k_cache[tables].permute(0, 2, 1, 4, 3).flatten(2, 3)[:, :, :max_len]  # [B, nkv, L, hd]
    v = v_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
    allowed = (torch.arange(max_len)[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=allowed, scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :].reshape(B, *q.shape[1:])
