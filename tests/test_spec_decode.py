"""MTP speculative decoding: greedy output identical to plain decoding for k = 1..4 (mixed with sampled
requests, chunked prefill, stop conditions inside an accepted run), sampled output distributed exactly as
the target (chi-square against the exact marginals), the MTP cache consistent with a from-scratch MTP
computation, no cache leaks, and clear errors for bad configs and checkpoints without an MTP head."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.assets import DEMO_DIR
from deltaserve.cli import build_parser
from deltaserve.engine.config import EngineConfigError
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.engine.sampler import SequenceSamplingState
from deltaserve.engine.scheduler import VERIFY
from deltaserve.engine.spec_policy import EXPLORE_EVERY, DraftPolicy
from deltaserve.model.context import ForwardContext
from deltaserve.model.loader import CheckpointError
from tests.checkpoints import RATIOS_27B, random_hf_model, random_mtp_tensors, save_official_layout
from tests.spec_costs import COMPUTE_BOUND, MEMORY_BOUND

V = RATIOS_27B["vocab_size"]


def spec(k: int, adaptive: bool = False) -> dict:
    """Fixed k unless adaptive: what a test checks must not depend on the step timings adaptive k reads."""
    return {"method": "mtp", "num_speculative_tokens": k, "adaptive": adaptive}


class NeverDrafts(DraftPolicy):
    """Adaptive k that finds drafting never pays: every request postpones its MTP pass."""

    def choose(self, rates: list[float], caps: list[int]) -> list[int]:
        return [0] * len(caps)


class EveryFourthStep(DraftPolicy):
    """Drafts the most it may on every fourth step and nothing in between, so requests postpone their MTP
    pass (Request.spec_backlog) and catch up later."""

    def choose(self, rates: list[float], caps: list[int]) -> list[int]:
        self.num_decisions += 1
        return list(caps) if self.num_decisions % 4 == 0 else [0] * len(caps)


def _agreeing_checkpoint(path: Path, damp: float) -> Path:
    """A random checkpoint whose MTP head tends to agree with the trunk, so both acceptance and rejection
    happen: large embeddings and mixer/MLP outputs scaled by `damp` make the trunk close to a bigram model
    of the current token, and the MTP head (fc passes the embedding through, its norm equals the trunk's
    final norm) predicts that same bigram of the token it is fed. A random MTP head is almost never right;
    damp 0.3 agrees often, 1.0 about half the time."""
    hf = random_hf_model(RATIOS_27B, seed=3)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(12.0)
        for name, p in hf.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                p.mul_(damp)
    mtp = random_mtp_tensors(RATIOS_27B, seed=4)
    H = RATIOS_27B["hidden_size"]
    mtp["mtp.fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    mtp["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(H)
    mtp["mtp.norm.weight"] = hf.model.norm.weight.detach().clone()
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        mtp[f"mtp.layers.0.{name}"] = mtp[f"mtp.layers.0.{name}"] * damp
    return save_official_layout(hf, path, mtp)


@pytest.fixture(scope="module")
def agreeable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _agreeing_checkpoint(tmp_path_factory.mktemp("agree"), damp=0.3)


@pytest.fixture(scope="module")
def half_agreeable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _agreeing_checkpoint(tmp_path_factory.mktemp("half"), damp=1.0)


def _prompts(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 17, 63, 65, 130] + torch.randint(3, 60, (n - 6,), generator=g).tolist()
    return [{"prompt_token_ids": torch.randint(2, V, (k,), generator=g).tolist()} for k in lengths]


def _all_free(engine: LLMEngine) -> None:
    u = engine.cache.usage()
    assert (u.used_blocks, u.used_slots) == (0, 0), f"leaked {u.used_blocks} blocks, {u.used_slots} slots"
    assert not engine.cache.block_tables and not engine.cache.state_slots


@pytest.fixture(scope="module")
def greedy_case(agreeable: Path) -> tuple[list[dict], list[SamplingParams], list[list[int]], list]:
    """Prompts, per-prompt params (greedy, some with stop tokens / short max_tokens / logprobs, and sampled
    ones mixed in) and the plain engine's outputs."""
    prompts = _prompts(12)
    params = []
    for i in range(len(prompts)):
        if i % 4 == 3:
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=[24, 7, 3][i % 3], ignore_eos=True,
                                         logprobs=2 if i % 5 == 0 else None))
    plain = LLM(model=str(agreeable), max_model_len=256, max_num_batched_tokens=24, max_num_seqs=16)
    outs = plain.generate(prompts, params, use_tqdm=False)
    # A stop token from the middle of one output: speculation must stop at the same place.
    ids = outs[0].outputs[0].token_ids
    params[0] = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[ids[10]], logprobs=2)
    outs[0] = plain.generate(prompts[0], params[0], use_tqdm=False)[0]
    assert outs[0].outputs[0].finish_reason == "stop"
    return prompts, params, [o.outputs[0].token_ids for o in outs], outs


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_speculation_is_token_for_token_plain_greedy(agreeable: Path, greedy_case, k: int) -> None:
    prompts, params, want, plain_outs = greedy_case
    llm = LLM(model=str(agreeable), max_model_len=256, max_num_batched_tokens=24, max_num_seqs=16,
              speculative_config=spec(k))
    kinds: list[set[str]] = []
    llm.engine.step_listeners.append(lambda s: kinds.append({kind for _, _, kind in s.summary()}))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (p, o) in enumerate(zip(params, outs, strict=True)):
        if p.greedy:
            assert o.outputs[0].token_ids == want[i], f"prompt {i} (k={k}) differs from plain greedy"
            assert o.outputs[0].finish_reason == plain_outs[i].outputs[0].finish_reason
            if p.logprobs is not None:
                for a, b in zip(o.outputs[0].logprobs, plain_outs[i].outputs[0].logprobs, strict=True):
                    assert a.keys() == b.keys()
                    assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
        else:
            assert len(o.outputs[0].token_ids) == p.max_tokens
    stats = llm.engine.stats().spec
    assert stats is not None and len(stats.accepted_per_position) == k
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "both acceptance and rejection"
    assert sum(o.spec.num_drafts for o in outs) == stats.num_drafts
    assert any(VERIFY in ks and len(ks) > 1 for ks in kinds), "no verify shared a step with other work"
    _all_free(llm.engine)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_int_weights_greedy_speculation_is_plain_greedy(agreeable: Path, quantization: str) -> None:
    """int8 / int4 weights (int8 activations), batched: greedy speculation is plain greedy token for token. A
    verify step's 8 x (1 + k) rows and a plain step's 8 may sum a row's float products in different orders (a
    near-tie of two logits could then part them); the AVX2 builds' integer kernels do not: their rows are the
    same bits in any number of rows (tests/test_int8_activations.py)."""
    prompts = _prompts(8, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kwargs = dict(model=str(agreeable), quantization=quantization, max_model_len=256, max_num_batched_tokens=64,
                  max_num_seqs=8)
    want = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**kwargs, speculative_config=spec(4))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = llm.engine.stats().spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "both acceptance and rejection"


@pytest.mark.parametrize("costs", [MEMORY_BOUND, COMPUTE_BOUND, None],
                         ids=["memory-bound", "compute-bound", "measured"])
def test_adaptive_speculation_is_token_for_token_plain_greedy(agreeable: Path, greedy_case, costs) -> None:
    """Adaptive k (max 3) changes how many drafts each request verifies, never the output: with given costs
    where drafting pays and where it does not, and with the costs this machine measures (whatever they are)."""
    prompts, params, want, plain_outs = greedy_case
    llm = LLM(model=str(agreeable), max_model_len=256, max_num_batched_tokens=24, max_num_seqs=16,
              speculative_config=spec(3, adaptive=True))
    policy = llm.engine.runner.spec.policy
    assert policy.adaptive
    if costs is not None:
        policy.costs = costs
    postponed = []
    llm.engine.step_listeners.append(
        lambda s: postponed.append(sum(r.spec_backlog > 0 for r in llm.engine.requests.values())))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (p, o) in enumerate(zip(params, outs, strict=True)):
        if p.greedy:
            assert o.outputs[0].token_ids == want[i], f"prompt {i} differs from plain greedy"
            assert o.outputs[0].finish_reason == plain_outs[i].outputs[0].finish_reason
        else:
            assert len(o.outputs[0].token_ids) == p.max_tokens
    stats = llm.engine.stats().spec
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if costs is MEMORY_BOUND:  # every request drafts its cap nearly always: about 3 drafts per verify
        assert stats.num_draft_tokens > 2 * stats.num_drafts > 0
    if costs is COMPUTE_BOUND:  # drafts only on the periodic exploration steps
        assert stats.num_drafts <= 2 * len(postponed) / EXPLORE_EVERY * len(prompts)
        assert stats.num_draft_tokens < tokens / 10
        assert max(postponed) > 0, "requests that draft nothing postpone their MTP pass"
    _all_free(llm.engine)


def test_adaptive_k_never_drafts_for_a_seeded_sampled_request(agreeable: Path) -> None:
    """Adaptive k's choice follows the machine's timings and the drafts a request verifies change its
    generator's draws, so a seeded sampled request gets no drafts: its tokens are the plain engine's, run
    after run, while the greedy and unseeded requests beside it draft (costs where drafting pays)."""
    prompts = _prompts(6, seed=7)
    params = [SamplingParams(temperature=0.9, seed=40 + i, max_tokens=24, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.0 if i % 4 == 0 else 0.9, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    plain = LLM(model=str(agreeable), max_model_len=256, speculative_config=None)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(model=str(agreeable), max_model_len=256, speculative_config=spec(3, adaptive=True))
    llm.engine.runner.spec.policy.costs = MEMORY_BOUND
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, o in enumerate(outs):
        if params[i].seed is not None:
            assert (o.spec is None or o.spec.num_draft_tokens == 0) and o.outputs[0].token_ids == want[i], i
        else:
            assert o.spec is not None and o.spec.num_draft_tokens > 0, f"request {i} drafted nothing"
    assert [o.outputs[0].token_ids for o in outs][0::4] == want[0::4]  # the greedy ones
    _all_free(llm.engine)


@pytest.mark.parametrize("has_mtp", [True, False])
def test_auto_speculation_follows_the_checkpoint(agreeable: Path, tmp_path: Path, monkeypatch,
                                                 has_mtp: bool) -> None:
    """The default, "auto": adaptive MTP (up to 3 drafts) for a checkpoint with an MTP head and at least
    AUTO_MIN_TEXT_PARAMS text parameters, off for a smaller one or one without the head; the engine's config
    then holds what it chose. The test checkpoints are tiny, so the threshold is lowered to see "on"."""
    from deltaserve.engine import spec_default

    path = agreeable if has_mtp else save_official_layout(random_hf_model(RATIOS_27B, seed=6), tmp_path)
    assert LLM(model=str(path), max_model_len=128).engine.config.speculative_config is None
    monkeypatch.setattr(spec_default, "AUTO_MIN_TEXT_PARAMS", 1)
    engine = LLM(model=str(path), max_model_len=128).engine
    if has_mtp:
        assert engine.config.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
        assert engine.runner.spec.policy.adaptive
    else:
        assert engine.config.speculative_config is None and engine.stats().spec is None
    assert LLM(model=str(path), max_model_len=128, speculative_config=None).engine.stats().spec is None


def test_auto_speculation_is_on_for_the_released_sizes_and_off_for_the_demo() -> None:
    from deltaserve.config import ModelConfig
    from deltaserve.engine.known_configs import known_config
    from deltaserve.engine.spec_default import speculates_by_default

    small = ModelConfig.from_dict(known_config("qwen3.5-0.8b"))
    assert speculates_by_default(small, has_mtp=True) and not speculates_by_default(small, has_mtp=False)
    assert not speculates_by_default(ModelConfig.from_file(DEMO_DIR), has_mtp=True)


def test_where_drafting_does_not_pay_requests_drop_their_mtp_upkeep(agreeable: Path) -> None:
    """Adaptive k that finds drafting does not pay (compute-bound costs): a request that fills a KV block
    without drafting drops its MTP upkeep, so once every request has, steps run no MTP pass and cost what
    plain steps do; greedy output stays plain greedy. Where drafting pays, nobody drops it."""
    prompts = [{"prompt_token_ids": p["prompt_token_ids"]} for p in _prompts(8, seed=11)]
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in
            LLM(model=str(agreeable), max_model_len=256).generate(prompts, params, use_tqdm=False)]
    for costs in (COMPUTE_BOUND, MEMORY_BOUND):
        engine, got, lapsed_steps, passes = _generate_counting_mtp_passes(agreeable, costs, prompts, params)
        assert got == want
        if costs is COMPUTE_BOUND:
            assert len(lapsed_steps) > 20, "requests dropped their MTP upkeep"
            assert not lapsed_steps & passes, "a step of lapsed requests ran an MTP pass"
        else:
            assert not lapsed_steps and engine.stats().spec.num_draft_tokens > 0
        _all_free(engine)


def test_adaptive_k_prices_steps_in_wall_time(agreeable: Path) -> None:
    """The policy's step costs are the time a user waits, not the process's CPU time: time no thread of
    the process spends computing (here a step listener sleeping 20 ms: at several threads, waiting threads
    and memory stalls; at one, other jobs) counts. CPU time weighed 2-thread steps wrongly (spec_policy)."""
    llm = LLM(model=str(agreeable), max_model_len=256, speculative_config=spec(3, adaptive=True))
    engine = llm.engine
    engine.step_listeners.append(lambda s: time.sleep(0.02))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate(_prompts(6, seed=3)[2:3], params, use_tqdm=False)
    steps = engine.runner.spec.policy.costs.steps
    assert steps.seconds and min(steps.seconds.values()) >= 0.02
    _all_free(engine)


def _generate_counting_mtp_passes(path: Path, costs, prompts, params):
    """Adaptive k (max 3) with the given costs: the engine, the outputs, the steps in which every request
    had dropped its MTP upkeep, and the steps that ran an MTP pass."""
    llm = LLM(model=str(path), max_model_len=256, speculative_config=spec(3, adaptive=True))
    engine = llm.engine
    engine.runner.spec.policy.costs = costs
    passes: set[int] = set()
    mtp = engine.runner.spec.mtp_hidden

    def counted(*args, **kwargs):
        passes.add(engine.num_steps)
        return mtp(*args, **kwargs)

    engine.runner.spec.mtp_hidden = counted
    lapsed: set[int] = set()

    def listen(s) -> None:
        if s.scheduled and all(x.request.spec_lapsed for x in s.scheduled):
            lapsed.add(engine.num_steps)

    engine.step_listeners.append(listen)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return engine, got, lapsed, passes


def _target_probs(model, sampler, prefixes: list[list[int]], prompt: list[int], params) -> torch.Tensor:
    """The exact distribution plain sampling draws the next token from, after each output prefix."""
    ids = torch.tensor([prompt + p for p in prefixes])
    L = ids.shape[1]
    with torch.no_grad():
        h = model(ids.flatten(), ForwardContext.stateless([L] * len(prefixes)))
        logits = model.compute_logits(h, torch.arange(len(prefixes)) * L + L - 1)
    states = [SequenceSamplingState(params, None, prompt, list(p)) for p in prefixes]
    return sampler.filtered_probs(sampler.process_logits(logits, states), states).double()


def _chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic (bins with expected count < 5 merged) and the 0.999 quantile of its chi-square
    distribution (Wilson-Hilferty), so a correct sampler fails one seed in a thousand."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.09
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_speculation_follows_the_target_distribution(half_agreeable: Path) -> None:
    """Tokens 2 and 3 of many seeded requests (drafted, accepted or rejected, resampled) against their
    exact marginals computed from the target with the same processing (temperature, top-k, penalties).
    A draft head that agrees about half the time makes both the acceptance test and the residual
    distribution matter (sampling the correction from p instead of max(p - q, 0) fails this test)."""
    N = 1000
    prompt = [5, 9, 17, 33]
    llm = LLM(model=str(half_agreeable), max_model_len=64, max_num_seqs=256, speculative_config=spec(2))
    params = [
        SamplingParams(temperature=1.0, top_k=8, presence_penalty=0.4, max_tokens=3, ignore_eos=True, seed=s)
        for s in range(N)
    ]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N, params, use_tqdm=False)
    toks = torch.tensor([o.outputs[0].token_ids for o in outs])  # [N, 3]
    stats = llm.engine.stats().spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    _all_free(llm.engine)

    model, sampler, p = llm.engine.model, llm.engine.runner.sampler, params[0]
    p1 = _target_probs(model, sampler, [[]], prompt, p)[0]  # [V]
    first = p1.nonzero().flatten().tolist()
    p2 = _target_probs(model, sampler, [[a] for a in first], prompt, p)  # [A, V]
    marg2 = (p1[first, None] * p2).sum(0)
    pairs = [(a, b) for i, a in enumerate(first) for b in p2[i].nonzero().flatten().tolist()]
    weight = torch.tensor([p1[a] * p2[first.index(a), b] for a, b in pairs], dtype=torch.float64)
    p3 = _target_probs(model, sampler, [list(ab) for ab in pairs], prompt, p)
    marg3 = (weight[:, None] * p3).sum(0)
    for pos, marg in ((1, marg2), (2, marg3)):
        counts = torch.bincount(toks[:, pos], minlength=V).double()
        stat, limit = _chi_square_ok(counts, marg)
        assert stat < limit, f"token {pos + 1}: chi-square {stat:.1f} >= {limit:.1f}"


@pytest.mark.parametrize("damp, postponing", [(0.3, False), (1.0, False), (0.3, True)])
def test_mtp_cache_gives_the_from_scratch_drafts(tmp_path: Path, damp: float, postponing: bool) -> None:
    """After several verify steps (accepts and rejects), the next drafts' distributions equal an MTP
    computation over the whole sequence with no cache: entries 0..t from trunk hiddens and real tokens,
    then the chain of draft entries fed their own hidden and token. Postponing: requests draft only every
    fourth step, postponing their MTP pass in between and catching up when they draft again."""
    path = _agreeing_checkpoint(tmp_path, damp)
    llm = LLM(model=str(path), max_model_len=256, max_num_batched_tokens=32, speculative_config=spec(3))
    engine = llm.engine
    if postponing:
        engine.runner.spec.policy = EveryFourthStep(3, adaptive=True)
    prompts = _prompts(8, seed=2)
    for i, p in enumerate(prompts):
        # unseeded: adaptive k (the postponing policy) gives a seeded sampled request no drafts
        engine.add_request(str(i), p, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True))
    held = 0  # the most MTP entries a request had postponed
    for _ in range(20):
        engine.step()
        held = max([held] + [r.spec_backlog for r in engine.requests.values()])
    assert (held >= 3) == postponing
    model = engine.model
    checked = 0
    for req in engine.requests.values():
        if len(req.spec_token_ids) < 3:
            continue
        ids = torch.tensor(req.prompt_token_ids + req.output_token_ids)
        T = len(ids)
        with torch.no_grad():
            h = model(ids, ForwardContext.stateless([T]))
            hidden, tokens = h[: T - 1], ids[1:]
            for j, (draft, q) in enumerate(zip(req.spec_token_ids, req.spec_draft_probs, strict=True)):
                m = model.mtp_hidden(tokens, hidden, ForwardContext.stateless([len(tokens)]))
                want = torch.softmax(model.compute_logits(m[-1:])[0], dim=-1)
                assert (want - q).abs().max() < 1e-4, f"draft {j + 1} of request {req.request_id}"
                hidden = torch.cat([hidden, m[-1:]])
                tokens = torch.cat([tokens, torch.tensor([draft])])
        checked += 1
    assert checked >= 3
    assert 0 < engine.stats().spec.num_accepted_tokens


def test_postponed_mtp_entries_still_fill_every_full_block(agreeable: Path) -> None:
    """A request that drafts nothing postpones its MTP pass, but never past a KV block boundary: every
    full block (which the prefix cache may hand to another request) holds the MTP K/V that an engine
    running the pass every step writes."""
    from tests.test_prefix_caching import _kv_rows

    prompt = {"prompt_token_ids": _prompts(6, seed=7)[2]["prompt_token_ids"]}  # 17 tokens
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    rows, held = [], 0
    for postponing in (False, True):
        llm = LLM(model=str(agreeable), max_model_len=128, speculative_config=spec(2))
        engine = llm.engine
        if postponing:
            engine.runner.spec.policy = NeverDrafts(2, adaptive=True)
        engine.add_request("r", prompt, params)
        req = engine.requests["r"]
        while req.num_computed_tokens < 70:
            engine.step()
            held = max(held, req.spec_backlog)
        rows.append(_kv_rows(engine, engine.model_config.num_hidden_layers, "r", 64))  # blocks 0..3
        if postponing:
            assert engine.stats().spec.num_drafts == 0
    assert held >= 5, "the request postponed its MTP entries"
    torch.testing.assert_close(rows[1], rows[0], rtol=1e-4, atol=1e-5)


def test_no_leaks_after_abort_preemption_and_finish(agreeable: Path) -> None:
    prompts = _prompts(10, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 5 + [
        SamplingParams(temperature=0.8, seed=s, max_tokens=24, ignore_eos=True) for s in range(5)
    ]
    roomy = LLM(model=str(agreeable), max_model_len=160, max_num_batched_tokens=48, max_num_seqs=8)
    want = roomy.generate(prompts, params, use_tqdm=False)
    tight = LLM(model=str(agreeable), max_model_len=160, max_num_batched_tokens=48, max_num_seqs=8,
                num_kv_blocks=11, speculative_config=spec(3))
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for w, g, p in zip(want, got, params, strict=True):
        if p.greedy:
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].token_ids) == 24
    _all_free(tight.engine)

    engine = tight.engine
    for i, p in enumerate(prompts[:6]):
        engine.add_request(f"a{i}", p, params[i])
    for _ in range(6):
        engine.step()
    assert any(r.spec_token_ids for r in engine.requests.values()), "abort while drafts are pending"
    engine.abort_request([f"a{i}" for i in range(0, 6, 2)])
    while engine.has_unfinished_requests():
        engine.step()
    _all_free(engine)


def test_checkpoint_without_mtp_is_a_clear_error(tmp_path: Path) -> None:
    save_official_layout(random_hf_model(RATIOS_27B, seed=6), tmp_path)
    with pytest.raises(CheckpointError, match="no mtp"):
        LLM(model=str(tmp_path), speculative_config=spec(2))


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "ngram", "num_speculative_tokens": 2}, "speculative_config.method 'ngram'"),
        ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "mtp", "num_speculative_tokens": "2"}, "num_speculative_tokens"),
        ({"method": "mtp"}, "num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown keys"),
        ({"method": "mtp", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive must be true or false"),
        ("mtp", r'must be "auto", None \(off\) or a dict'),
    ],
)
def test_bad_speculative_config_names_the_field(config, match: str) -> None:
    from deltaserve.engine.config import EngineConfig

    with pytest.raises(EngineConfigError, match=match):
        EngineConfig(speculative_config=config)


def test_cli_speculative_config_flag(capsys) -> None:
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--speculative-config", '{"method":"mtp","num_speculative_tokens":3}']
    )
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    assert build_parser().parse_args(["generate", "--prompt", "x"]).speculative_config == "auto"
    assert build_parser().parse_args(["generate", "--prompt", "x", "--speculative-config", "off"]
                                     ).speculative_config is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--speculative-config", "{method: mtp}"])
    assert "not valid JSON" in capsys.readouterr().err
    assert isinstance(args, argparse.Namespace)


@pytest.mark.skipif(not (DEMO_DIR / "model.safetensors").exists(), reason="demo checkpoint not built yet")
def test_demo_checkpoint_greedy_speculation_accepts_and_matches() -> None:
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3, 4, 5,", "今天天气"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(max_model_len=256).generate(prompts, params, use_tqdm=False)]
    llm = LLM(max_model_len=256, speculative_config=spec(3))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.engine.stats().spec.acceptance_rate > 0.2


@pytest.mark.skipif(not (DEMO_DIR / "model.safetensors").exists(), reason="demo checkpoint not built yet")
def test_a_picture_in_the_prompt_keeps_greedy_speculation_plain_greedy() -> None:
    """Every released Qwen3.5 carries a vision tower, and "auto" speculates on them: the demo (which has one)
    with a picture mid-prompt, its merged visual tokens and 3-D positions, drafts and stays plain greedy,
    with fixed and adaptive k."""
    from PIL import Image, ImageDraw

    from tests.test_demo_vision import data_url

    image = Image.new("RGB", (224, 160), "white")
    ImageDraw.Draw(image).ellipse((40, 30, 140, 130), fill="red")
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": "What shape is in the picture?"}]}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = LLM(max_model_len=512, speculative_config=None).chat(messages, params, use_tqdm=False)[0]
    for config in (spec(2), spec(3, adaptive=True)):
        llm = LLM(max_model_len=512, speculative_config=config)
        got = llm.chat(messages, params, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, config
        assert llm.engine.stats().spec.num_accepted_tokens > 0, config


def test_server_metrics_export_the_spec_counters(agreeable: Path) -> None:
    from deltaserve.serve.metrics import ServerMetrics

    llm = LLM(model=str(agreeable), max_model_len=128, speculative_config=spec(2))
    metrics = ServerMetrics("m")
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=20, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        metrics.on_iteration(engine)
    text = metrics.render().decode()
    s = engine.stats().spec
    name = "deltaserve:spec_decode_num"
    assert f'{name}_drafts_total{{model_name="m"}} {float(s.num_drafts)}' in text
    assert f'{name}_accepted_tokens_total{{model_name="m"}} {float(s.num_accepted_tokens)}' in text
    pos0 = float(s.accepted_per_position[0])
    assert f'{name}_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {pos0}' in text


def test_inter_token_latencies_count_steps_as_vllm_does(agreeable: Path) -> None:
    """A verify step emits several tokens at once: like vLLM, it records one inter-token latency (the time
    since the request's previous tokens), not one per token (zeros for the accepted drafts); the gaps add
    up to the decode time, and the time per output token is that time over the tokens after the first,
    which the server exports as request_time_per_output_token_seconds."""
    from deltaserve.serve.metrics import ServerMetrics

    llm = LLM(model=str(agreeable), max_model_len=256, speculative_config=spec(3))
    metrics = ServerMetrics("m")
    out = llm.generate(_prompts(6, seed=5), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                       use_tqdm=False)
    assert llm.engine.stats().spec.num_accepted_tokens > 0
    for o in out:
        m, tokens = o.metrics, len(o.outputs[0].token_ids)
        assert len(m.inter_token_latencies) == tokens - 1 - o.spec.num_accepted_tokens
        assert min(m.inter_token_latencies) > 0
        assert sum(m.inter_token_latencies) == pytest.approx(m.last_token_time - m.first_token_time, rel=1e-9)
        assert m.num_generation_tokens == tokens
        assert m.time_per_output_token == pytest.approx((m.last_token_time - m.first_token_time) / (tokens - 1))
        metrics.on_output(o)
    text = metrics.render().decode()
    assert 'deltaserve:request_time_per_output_token_seconds_count{model_name="m"} 6.0' in text
    gaps = sum(len(o.metrics.inter_token_latencies) for o in out)
    assert f'deltaserve:inter_token_latency_seconds_count{{model_name="m"}} {float(gaps)}' in text
