"""Causal grouped-query attention over a paged KV cache.

Cache layout per attention layer: v_cache [num_blocks, block_size, nkv, hd] and, transposed within each
block, k_cache [num_blocks, nkv, hd, block_size]: a block's keys of one head and one dim are contiguous,
so the fused step scores a query against a whole block with vector FMAs (no per-key horizontal sums). A
sequence owns the blocks listed in its block table; its token at position p lives in block
table[p // block_size], at offset p % block_size. Query head h reads kv head h // (nh / nkv).

An fp8 cache (torch.float8_e4m3fn, `--kv-cache-dtype fp8`) holds each token's K and V of each KV head as
E4M3 codes with one fp32 scale per (token, kv head), computed when the token is written: scale =
amax(|row|) / 448 (E4M3's largest finite value), code = fp8(row / scale), value read = code * scale. So no
row clips and every row uses the full 3-bit mantissa, whatever the checkpoint's activation range; vLLM's
default instead divides by one per-tensor k_scale / v_scale of 1.0 (no calibration), which clips |x| > 448
and loses small rows to E4M3's subnormals. On the demo, whose K/V sit well inside E4M3's range, the per-row
scale is only slightly the closer (docs/benchmarks.md, "fp8 KV cache"); it is chosen for not depending on
the checkpoint's activation sizes (docs/architecture.md, "KV cache dtypes"). The scales cost 4 bytes per
64-256 one-byte values:
k_scale [num_blocks, nkv, block_size] (a block's scales of one head contiguous, like its keys) and
v_scale [num_blocks, block_size, nkv].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def kv_cache_shapes(num_blocks: int, block_size: int, nkv: int, hd: int) -> tuple[tuple, tuple]:
    """Shapes of k_cache and v_cache (see the module docstring)."""
    return (num_blocks, nkv, hd, block_size), (num_blocks, block_size, nkv, hd)


def kv_scale_shapes(num_blocks: int, block_size: int, nkv: int) -> tuple[tuple, tuple]:
    """Shapes of an fp8 cache's k_scale and v_scale (see the module docstring)."""
    return (num_blocks, nkv, block_size), (num_blocks, block_size, nkv)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., hd] -> E4M3 codes [..., hd] and fp32 scales [...], one per row: scale = amax / 448 (1 for a
    zero row), code = fp8(x / scale). The fused step's writes compute exactly this (tests/test_kernels.py)."""
    x = x.float()
    amax = x.abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scale[..., None]).to(FP8), scale


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store k, v [T, nkv, hd] at flat slots [T] (block * block_size + offset); an fp8 cache also stores
    their row scales in scales = (k_scale, v_scale)."""
    block_size, nkv, hd = v_cache.shape[1:]
    blocks, offsets = slots // block_size, slots % block_size
    if scales is not None:
        k_scale, v_scale = scales
        (k, k_rows), (v, v_rows) = quantize_fp8(k), quantize_fp8(v)
        v_scale.view(-1, nkv).index_copy_(0, slots, v_rows)
        k_scale[blocks, :, offsets] = k_rows
        # torch's index_copy_ / index_put_ have no fp8 kernels: the codes go in as bytes
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
    v_cache.view(-1, nkv, hd).index_copy_(0, slots, v.to(v_cache.dtype))
    k_cache[blocks, :, :, offsets] = k.to(k_cache.dtype)


def gather_keys(
    k_cache: torch.Tensor, block_table: torch.Tensor, length: int, k_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The first `length` cached keys of one sequence, [length, nkv, hd] (an fp8 cache's dequantized)."""
    block_size = k_cache.shape[-1]
    blocks = block_table[: (length + block_size - 1) // block_size]
    keys = k_cache[blocks].permute(0, 3, 1, 2).flatten(0, 1)[:length]
    if k_scale is None:
        return keys
    return keys.float() * k_scale[blocks].transpose(1, 2).flatten(0, 1)[:length, :, None]


def gather_values(
    v_cache: torch.Tensor, block_table: torch.Tensor, length: int, v_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The first `length` cached values of one sequence, [length, nkv, hd] (an fp8 cache's dequantized)."""
    block_size = v_cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size]
    values = v_cache[blocks].flatten(0, 1)[:length]
    if v_scale is None:
        return values
    return values.float() * v_scale[blocks].flatten(0, 1)[:length, :, None]


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
    seq_len: int, scale: float, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One sequence: q [Tq, nh, hd] for positions seq_len-Tq .. seq_len-1, whose K/V are already written
    (scales: an fp8 cache's (k_scale, v_scale))."""
    Tq = q.shape[0]
    k_scale, v_scale = scales if scales is not None else (None, None)
    # A leading batch dim matters: 4-D inputs take torch's fused CPU kernel, 3-D ones the slow math path.
    k = gather_keys(k_cache, block_table, seq_len, k_scale).to(q.dtype).transpose(0, 1)[None]  # [1, nkv, L, hd]
    v = gather_values(v_cache, block_table, seq_len, v_scale).to(q.dtype).transpose(0, 1)[None]
    qh = q.transpose(0, 1)[None]  # [1, nh, Tq, hd]
    if Tq == seq_len:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        allowed = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - Tq, seq_len)[:, None]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """B sequences with one query each: q [B, nh, hd], block_tables [B, nb] (padded), seq_lens [B]
    (scales: an fp8 cache's (k_scale, v_scale))."""
    B = q.shape[0]
    block_size = v_cache.shape[1]
    max_len = int(seq_lens.max())
    nb = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :nb]
    k = k_cache[tables].permute(0, 2, 1, 4, 3).flatten(2, 3)[:, :, :max_len]  # [B, nkv, L, hd]
    v = v_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
    if scales is not None:  # [B, nb, nkv, bs] -> [B, nkv, L, 1] and [B, nb, bs, nkv] -> [B, nkv, L, 1]
        k_scale, v_scale = scales
        k = k.float() * k_scale[tables].transpose(1, 2).flatten(2, 3)[:, :, :max_len, None]
        v = v.float() * v_scale[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)[..., None]
        k, v = k.to(q.dtype), v.to(q.dtype)
    allowed = (torch.arange(max_len)[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=allowed, scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :].reshape(B, *q.shape[1:])
