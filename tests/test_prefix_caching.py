"""Prefix caching (KV blocks + GDN snapshots, "align" mode) end to end: outputs identical with and without
it, hits of exactly the expected length, eviction under pressure, no leaks, MTP speculation on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.llm_engine import LLMEngine
from tests.checkpoints import TINY, random_hf_model, random_mtp_tensors, save_official_layout

BS = 16
SNAP = 64  # mamba_block_size in these tests: a snapshot every 4 blocks of a prompt
V = TINY["vocab_size"]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_official_layout(random_hf_model(TINY, seed=1), tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_official_layout(
        random_hf_model(TINY, seed=1), tmp_path_factory.mktemp("mtp"), random_mtp_tensors(TINY, seed=2)
    )


def _tokens(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(2, V, (n,), generator=g).tolist()


def _engine(path: Path, caching: bool, **kw) -> LLM:
    kw.setdefault("max_model_len", 512)
    kw["enable_prefix_caching"] = caching
    if caching:
        kw["mamba_block_size"] = SNAP
    return LLM(model=str(path), **kw)


def _aligned_end(n: int) -> int:
    """The prompt-end snapshot point of an n-token prompt."""
    return (n - 1) // BS * BS


def _answer_end(out) -> int:
    """The last block boundary a finished request computed (its last sampled token never ran): where its
    last decode snapshot is, so where the next turn of its chat hits."""
    return (len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1) // BS * BS


def _no_leaks(engine: LLMEngine) -> None:
    cache = engine.cache
    u = cache.usage()
    assert (u.used_blocks, u.used_slots) == (0, 0), f"leaked {u.used_blocks} blocks, {u.used_slots} slots"
    assert not any(cache.blocks.ref_counts), "a block kept a reference"
    assert not cache.block_tables and not cache.state_slots
    p = cache.prefix
    assert not p._hashes and not p._points and not p._num_registered and not p._decode_snapshot, \
        "per-request prefix state leaked"
    assert not engine.scheduler.running and not engine.scheduler.waiting


def _chat(llm: LLM, turns: int, params: SamplingParams, seed: int, first: int = 150) -> list:
    """A multi-turn conversation: every turn's prompt is the last prompt, its answer and a new message."""
    g = torch.Generator().manual_seed(seed)
    prompt = _tokens(first, g)
    outs = []
    for _ in range(turns):
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        outs.append(out)
        prompt = prompt + out.outputs[0].token_ids + _tokens(int(torch.randint(5, 40, (1,), generator=g)), g)
    return outs


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
}


@pytest.mark.parametrize(("eager", "budget", "kv"), [
    (False, 2048, "auto"), (True, 2048, "auto"), (False, 40, "auto"), (True, 40, "auto"),
    (False, 40, "fp8"), (True, 40, "fp8"),  # an fp8 KV cache: blocks of codes and their scales are shared
], ids=["fused-whole", "eager-whole", "fused-chunked", "eager-chunked", "fused-chunked-fp8", "eager-chunked-fp8"])
def test_multi_turn_chat_same_outputs_and_hits_at_the_last_answer_boundary(path: Path, eager: bool,
                                                                         budget: int, kv: str) -> None:
    kw = dict(enforce_eager=eager, max_num_batched_tokens=budget, kv_cache_dtype=kv)
    plain, cached = _engine(path, False, **kw), _engine(path, True, **kw)
    for seed, (kind, params) in enumerate(PARAMS.items()):
        want = _chat(plain, 5, params, seed=seed)  # a new conversation per kind: no hit on the first turn
        got = _chat(cached, 5, params, seed=seed)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want], kind
        # Turn k reuses turn k-1's prompt and answer up to their last block boundary (a decode snapshot).
        expect = [0] + [_answer_end(o) for o in got[:-1]]
        assert [o.num_cached_tokens for o in got] == expect, kind
        assert all(o.num_cached_tokens == 0 for o in want)
        if seed == 0:
            hits_before = sum(expect)
    stats = cached.engine.stats().prefix_cache
    assert stats.hits == sum(o.num_cached_tokens for o in got) + hits_before and stats.requests == 10
    _no_leaks(cached.engine)


@pytest.mark.parametrize("budget", [2048, 40], ids=["whole", "chunked"])
def test_eight_turn_chat_reuses_the_previous_prompt_and_answer(path: Path, budget: int) -> None:
    """Every turn n+1 starts after turn n's prompt AND answer (to a block multiple), whatever the answer's
    length: shorter than a block, ending on a boundary, spanning several blocks; the answers are those of
    the uncached engine. The hit reaches past the previous prompt's end wherever the answer crosses a
    block boundary, which only a snapshot taken during decode gives."""
    g = torch.Generator().manual_seed(21)
    plain = _engine(path, False, max_num_batched_tokens=budget)
    cached = _engine(path, True, max_num_batched_tokens=budget)
    prompt = _tokens(160, g)  # a whole number of blocks: the prompt's own end is a decode-side boundary
    lengths = [12, 40, 3, 17, 16, 33, 1, 20]  # answers in tokens (ignore_eos: each runs to its max_tokens)
    got, want = [], []
    for max_tokens in lengths:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        want.append(plain.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0])
        got.append(cached.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0])
        assert got[-1].outputs[0].token_ids == want[-1].outputs[0].token_ids
        prompt = prompt + got[-1].outputs[0].token_ids + _tokens(int(torch.randint(4, 30, (1,), generator=g)), g)
    hits = [o.num_cached_tokens for o in got]
    assert hits == [0] + [_answer_end(o) for o in got[:-1]]
    assert all(h % BS == 0 for h in hits)
    past_prompt = [h > _aligned_end(len(o.prompt_token_ids)) for h, o in zip(hits[1:], got, strict=False)]
    assert sum(past_prompt) >= 5, past_prompt  # the answers of 12 to 40 tokens all cross a boundary
    # Each request held one decode snapshot at a time: the pool keeps at most one per finished turn beyond
    # the prompt points, not one per block it decoded.
    assert cached.engine.cache.prefix.snapshots.num_used <= 3 * len(lengths)
    _no_leaks(cached.engine)


def test_shared_system_prompt_in_sequence_hits_at_the_divergence_point(path: Path) -> None:
    """A 180-token system prompt (11 whole blocks) and different questions: the second request finds the
    blocks but only the 128-token snapshot and snapshots the common 176; every later one hits 176."""
    g = torch.Generator().manual_seed(5)
    system = _tokens(180, g)
    prompts = [{"prompt_token_ids": system + [2 + i] + _tokens(20 + 3 * i, g)} for i in range(6)]
    params = PARAMS["greedy"]
    plain, cached = _engine(path, False), _engine(path, True)
    want = [plain.generate([p], params, use_tqdm=False)[0] for p in prompts]
    got = [cached.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.num_cached_tokens for o in got] == [0, 128, 176, 176, 176, 176]
    _no_leaks(cached.engine)


@pytest.mark.parametrize("eager", [False, True], ids=["fused", "eager"])
def test_shared_system_prompt_arriving_in_one_batch(path: Path, eager: bool) -> None:
    """All at once, two at a time (max_num_seqs=2) with small chunks: the same outputs as without
    caching, and the later requests reuse the system prompt."""
    g = torch.Generator().manual_seed(6)
    system = _tokens(180, g)
    prompts = [{"prompt_token_ids": system + [2 + i] + _tokens(10 + 7 * i, g)} for i in range(8)]
    params = [PARAMS["greedy"]] * 4 + [
        SamplingParams(temperature=0.8, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)
    ]
    kw = dict(max_num_seqs=2, max_num_batched_tokens=48, enforce_eager=eager)
    want = _engine(path, False, **kw).generate(prompts, params, use_tqdm=False)
    llm = _engine(path, True, **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    cached = [o.num_cached_tokens for o in got]
    assert all(c % BS == 0 and c <= 176 for c in cached) and cached[-1] == 176, cached
    assert sum(cached) == llm.engine.stats().prefix_cache.hits
    _no_leaks(llm.engine)


def test_same_prompt_again_hits_all_but_its_last_block(path: Path) -> None:
    g = torch.Generator().manual_seed(8)
    for n in (64, 70, 15):  # a whole number of blocks, not, and less than one block
        prompt = {"prompt_token_ids": _tokens(n, g)}
        llm = _engine(path, True)
        first, again = (llm.generate([prompt], PARAMS["greedy"], use_tqdm=False)[0] for _ in range(2))
        assert first.outputs[0].token_ids == again.outputs[0].token_ids
        assert (first.num_cached_tokens, again.num_cached_tokens) == (0, _aligned_end(n))


def test_cache_salt_keeps_prefixes_apart(path: Path) -> None:
    g = torch.Generator().manual_seed(9)
    ids = _tokens(100, g)
    llm = _engine(path, True)
    outs = [
        llm.generate([p], PARAMS["greedy"], use_tqdm=False)[0]
        for p in ({"prompt_token_ids": ids, "cache_salt": "alice"}, {"prompt_token_ids": ids, "cache_salt": "bob"},
                  {"prompt_token_ids": ids, "cache_salt": "alice"}, {"prompt_token_ids": ids})
    ]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 96, 0]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate([{"prompt_token_ids": ids, "cache_salt": 3}], use_tqdm=False)


def test_memory_pressure_evicts_blocks_and_snapshots_then_recomputes(path: Path) -> None:
    """Three conversations in a cache of 24 blocks and 3 snapshots: each conversation's second turn, right
    after its first, hits; by the time a conversation comes back its blocks and snapshots were evicted
    for the others, so it recomputes its prefix. Outputs stay those of the uncached engine."""
    kw = dict(max_model_len=320, max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=24)
    plain = _engine(path, False, **kw)
    llm = _engine(path, True, num_gdn_snapshots=3, **kw)
    g = torch.Generator().manual_seed(10)
    convs = [_tokens(90 + 13 * i, g) for i in range(3)]
    params = PARAMS["greedy"]
    cached, outs = [], []
    for c in (0, 0, 1, 1, 2, 2, 0, 1):
        prompt = convs[c]
        want = plain.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        cached.append(got.num_cached_tokens)
        outs.append(got)
        convs[c] = prompt + got.outputs[0].token_ids + _tokens(9, g)
    pool, snaps = llm.engine.cache.blocks, llm.engine.cache.prefix.snapshots
    assert pool.num_evicted > 0 and snaps.num_evicted > 0 and snaps.num_used == 3
    hits = [0, _answer_end(outs[0]), 0, _answer_end(outs[2]), 0, _answer_end(outs[4]), 0, 0]
    assert cached == hits
    _no_leaks(llm.engine)


def test_preemption_and_abort_keep_cached_blocks_valid_and_leak_nothing(path: Path) -> None:
    g = torch.Generator().manual_seed(11)
    system = _tokens(100, g)
    prompts = [{"prompt_token_ids": system + _tokens(5 + 4 * i, g)} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    kw = dict(max_model_len=192, max_num_seqs=4, max_num_batched_tokens=48)
    want = _engine(path, False, **kw).generate(prompts, params, use_tqdm=False)
    tight = _engine(path, True, num_kv_blocks=20, **kw)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    _no_leaks(tight.engine)

    engine = tight.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, params)
    for step in range(300):
        if step == 5:
            engine.abort_request(["a0", "a3", "a7"])
        engine.step()
        if not engine.has_unfinished_requests():
            break
    _no_leaks(engine)
    # What stayed cached is still right: the same prompts again hit and give the same tokens.
    again = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want]
    assert all(o.num_cached_tokens > 0 for o in again)
    _no_leaks(engine)


def test_speculative_decoding_same_outputs_and_mtp_next_token_rule(mtp_path: Path) -> None:
    """With MTP drafting, outputs and acceptance are those of the uncached engine (the cached MTP K/V is
    right), and a block is reused only by a request with the same next token: two prompts equal for 192
    tokens that differ at token 192 share 128 tokens (the snapshot before the last shared block), not 192;
    the second snapshots 176, which the third then reuses."""
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    g = torch.Generator().manual_seed(12)
    common = _tokens(192, g)
    prompts = [{"prompt_token_ids": common + [2 + i] + _tokens(30, g)} for i in range(3)]
    for params in PARAMS.values():
        plain = _engine(mtp_path, False, speculative_config=spec, max_num_batched_tokens=48)
        llm = _engine(mtp_path, True, speculative_config=spec, max_num_batched_tokens=48)
        want = [plain.generate([p], params, use_tqdm=False)[0] for p in prompts]
        want += _chat(plain, 4, params, seed=13)
        got = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        got += _chat(llm, 4, params, seed=13)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert [o.spec.num_accepted_tokens for o in got] == [o.spec.num_accepted_tokens for o in want]
        assert [o.num_cached_tokens for o in got[:3]] == [0, 128, 176]
        # A chat turn hits at least the previous prompt's end, and up to its answer's last block boundary
        # when a step ended on one (a verify that moves several tokens may jump over a boundary).
        chat = got[3:]
        assert chat[0].num_cached_tokens == 0
        for prev, o in zip(chat, chat[1:], strict=False):
            assert _aligned_end(len(prev.prompt_token_ids)) <= o.num_cached_tokens <= _answer_end(prev)
            assert o.num_cached_tokens % BS == 0
        _no_leaks(llm.engine)
    # Without speculation the next token does not matter: the second prompt reuses all 192.
    llm = _engine(mtp_path, True)
    assert [llm.generate([p], PARAMS["greedy"], use_tqdm=False)[0].num_cached_tokens for p in prompts] == [0, 192, 192]


def _kv_rows(engine: LLMEngine, layer: int, request_id: str, n: int) -> torch.Tensor:
    """K and V of positions [0, n) of a running request in one layer's paged cache, [n, 2 * nkv * hd]."""
    k, v = engine.cache_tensors.kv[layer]  # [blocks, nkv, hd, bs], [blocks, bs, nkv, hd]
    table = engine.cache.block_tables[request_id]
    rows = [torch.cat([k[table[p // BS], :, :, p % BS].flatten(), v[table[p // BS], p % BS].flatten()])
            for p in range(n)]
    return torch.stack(rows)


def test_reused_blocks_hold_the_mtp_entries_an_uncached_run_computes(mtp_path: Path) -> None:
    """After a hit, every cached position of the trunk's attention layer and of the MTP layer holds what
    the uncached engine computed for the same request: in particular the MTP entry at the last reused
    position, made from the next token, which differs between the two prompts."""
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    g = torch.Generator().manual_seed(14)
    common = _tokens(192, g)
    first, second = (common + [2 + i] + _tokens(20, g) for i in range(2))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rows = []
    for caching in (False, True):
        llm = _engine(mtp_path, caching, speculative_config=spec, max_num_batched_tokens=64)
        engine = llm.engine
        llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
        engine.add_request("b", {"prompt_token_ids": second}, params)
        req = engine.requests["b"]
        while len(req.output_token_ids) < 2:
            engine.step()
        n = req.num_computed_tokens
        cfg = engine.model_config
        rows.append([_kv_rows(engine, layer, "b", n) for layer in (cfg.attention_layer_ids[0], cfg.num_hidden_layers)])
        assert req.num_cached_tokens == (128 if caching else 0)
        while engine.has_unfinished_requests():
            engine.step()
    for plain, cached in zip(*rows, strict=True):
        torch.testing.assert_close(cached, plain, rtol=1e-4, atol=1e-5)
