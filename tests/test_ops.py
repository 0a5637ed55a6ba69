"""Every fast kernel against its plain-torch reference on random inputs, with non-zero initial state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.attention import (
    attention_reference,
    decode_attention,
    gather_keys,
    gather_values,
    kv_cache_shapes,
    prefill_attention,
    write_kv,
)
from deltaserve.ops.conv import causal_conv1d, causal_conv1d_reference, causal_conv1d_step
from deltaserve.ops.delta_rule import (
    delta_rule_chunked,
    delta_rule_recurrent,
    delta_rule_reference,
    delta_rule_step,
)


def delta_inputs(T: int, H: int = 3, dk: int = 8, dv: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, H, dk, generator=g), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(T, H, dk, generator=g), dim=-1)
    v = torch.randn(T, H, dv, generator=g)
    decay = -torch.rand(T, H, generator=g) * 3
    beta = torch.rand(T, H, generator=g)
    state = torch.randn(H, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 200])
def test_chunked_delta_rule_matches_reference(T):
    q, k, v, g, beta, s0 = delta_inputs(T, seed=T)
    ref_o, ref_s = delta_rule_reference(q, k, v, g, beta, s0)
    o, s = delta_rule_chunked(q, k, v, g, beta, s0)
    assert (o - ref_o).abs().max() < 1e-5
    assert (s - ref_s).abs().max() < 1e-5
    o0, s0_ = delta_rule_chunked(q, k, v, g, beta, None)
    r0, rs0 = delta_rule_reference(q, k, v, g, beta, None)
    assert (o0 - r0).abs().max() < 1e-5 and (s0_ - rs0).abs().max() < 1e-5


def test_chunked_delta_rule_with_small_chunks_and_strong_decay():
    q, k, v, g, beta, s0 = delta_inputs(50, seed=9)
    g = g * 10  # decays down to exp(-30) within a chunk must not overflow the masked exponent
    ref_o, ref_s = delta_rule_reference(q, k, v, g, beta, s0)
    o, s = delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=16)
    assert (o - ref_o).abs().max() < 1e-5 and (s - ref_s).abs().max() < 1e-5


def test_recurrent_steps_match_reference_for_a_batch():
    seqs = [delta_inputs(6, seed=s) for s in range(3)]
    q, k, v, g, beta, s0 = (torch.stack(parts) for parts in zip(*seqs))
    out, states = delta_rule_recurrent(q, k, v, g, beta, s0)
    for b, (qb, kb, vb, gb, bb, sb) in enumerate(seqs):
        ref_o, ref_s = delta_rule_reference(qb, kb, vb, gb, bb, sb)
        assert (out[b] - ref_o).abs().max() < 1e-5
        assert (states[b, -1] - ref_s).abs().max() < 1e-5
        # the state after each token is kept (speculative verification rolls back to one of them)
        _, mid = delta_rule_reference(qb[:3], kb[:3], vb[:3], gb[:3], bb[:3], sb)
        assert (states[b, 2] - mid).abs().max() < 1e-5
    one_o, one_s = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0)
    assert (one_o - out[:, 0]).abs().max() == 0 and (one_s - states[:, 0]).abs().max() == 0


def test_conv_matches_reference_and_carries_state():
    g = torch.Generator().manual_seed(0)
    C, K, T = 10, 4, 23
    x, w, state = torch.randn(T, C, generator=g), torch.randn(C, K, generator=g), torch.randn(C, K - 1, generator=g)
    ref, ref_state = causal_conv1d_reference(x, w, state)
    out, new_state = causal_conv1d(x, w, state)
    assert (out - ref).abs().max() < 1e-5 and torch.equal(new_state, ref_state)
    # in two pieces with the carried state == in one piece
    a, sa = causal_conv1d(x[:9], w, state)
    b, sb = causal_conv1d(x[9:], w, sa)
    assert (torch.cat([a, b]) - ref).abs().max() < 1e-5 and torch.equal(sb, ref_state)
    # token by token through the batched decode step
    s, steps = state[None], []
    for t in range(T):
        o, s = causal_conv1d_step(x[t][None], w, s)
        steps.append(o[0])
    assert (torch.stack(steps) - ref).abs().max() < 1e-5 and torch.equal(s[0], ref_state)
    # zero state == left zero padding
    padded = F.conv1d(F.pad(x.t(), (K - 1, 0))[None], w[:, None, :], groups=C)[0].t()
    assert (causal_conv1d(x, w, torch.zeros(C, K - 1))[0] - padded).abs().max() < 1e-5


def paged_setup(lengths, nkv=2, hd=8, block_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum((n + block_size - 1) // block_size for n in lengths) + 3
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, nkv, hd)
    k_cache, v_cache = torch.zeros(k_shape), torch.zeros(v_shape)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks
    tables, kvs = [], []
    for n in lengths:
        nb = (n + block_size - 1) // block_size
        table = torch.tensor([perm.pop() for _ in range(nb)])
        k, v = torch.randn(n, nkv, hd, generator=g), torch.randn(n, nkv, hd, generator=g)
        slots = table[torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        write_kv(k_cache, v_cache, slots, k, v)
        tables.append(table)
        kvs.append((k, v))
    return k_cache, v_cache, tables, kvs


def test_paged_prefill_attention_matches_reference():
    k_cache, v_cache, tables, kvs = paged_setup([13, 30])
    g = torch.Generator().manual_seed(1)
    for table, (k, v), tq in zip(tables, kvs, [13, 5]):
        assert torch.equal(gather_keys(k_cache, table, len(k)), k)
        assert torch.equal(gather_values(v_cache, table, len(v)), v)
        q = torch.randn(tq, 6, 8, generator=g)
        out = prefill_attention(q, k_cache, v_cache, table, len(k), 8**-0.5)
        assert (out - attention_reference(q, k, v, 8**-0.5)).abs().max() < 1e-5


def test_paged_decode_attention_matches_reference():
    lengths = [1, 9, 17]
    k_cache, v_cache, tables, kvs = paged_setup(lengths, seed=2)
    width = max(len(t) for t in tables)
    padded = torch.zeros(len(tables), width, dtype=torch.long)
    for b, t in enumerate(tables):
        padded[b, : len(t)] = t
    q = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(3))
    out = decode_attention(q, k_cache, v_cache, padded, torch.tensor(lengths), 8**-0.5)
    for b, (k, v) in enumerate(kvs):
        assert (out[b] - attention_reference(q[b][None], k, v, 8**-0.5)[0]).abs().max() < 1e-5
