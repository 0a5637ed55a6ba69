"""SamplingParams validation and the Sampler: exact logit transformations, and the distributions samples
follow (fixed seeds, so every run sees the same draws; bounds are loose enough to hold for any seed)."""

from __future__ import annotations

import math

import pytest
import torch

from deltaserve.engine.sampler import (
    Sampler,
    SequenceSamplingState,
    make_sampling_state,
    validate_params_for_vocab,
)
from deltaserve.sampling import SamplingParams

EOS = 7
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])  # V = 8
DRAWS = 20_000


# ---- SamplingParams -----------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 1.5), ("min_p", -0.1), ("min_p", 1.1),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 3.0),
    ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1), ("logprobs", 21), ("seed", "x"),
    ("logit_bias", {"a": 1.0}), ("logit_bias", {1: "x"}), ("logit_bias", {1: float("inf")}),
    ("stop", [""]), ("stop_token_ids", [-1]),
])
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_error_message_names_value() -> None:
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)


def test_defaults_and_normalisation() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and not p.greedy
    p = SamplingParams(stop="###", stop_token_ids=(3, 4), logit_bias={"5": 1.0}, top_k=-1)
    assert p.stop == ["###"] and p.stop_token_ids == [3, 4] and p.logit_bias == {5: 1.0}
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    c = p.clone()
    c.stop.append("x")
    assert p.stop == ["###"]


def test_validate_params_for_vocab() -> None:
    validate_params_for_vocab(SamplingParams(logit_bias={7: 1.0}, stop_token_ids=[7]), 8)
    with pytest.raises(ValueError, match="logit_bias"):
        validate_params_for_vocab(SamplingParams(logit_bias={8: 1.0}), 8)
    with pytest.raises(ValueError, match="stop_token_ids"):
        validate_params_for_vocab(SamplingParams(stop_token_ids=[99]), 8)


# ---- helpers ------------------------------------------------------------------------------------------
def _state(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
            seed_offset: int = 0) -> SequenceSamplingState:
    s = make_sampling_state(params, prompt or [], seed_offset)
    s.output_token_ids = list(output or [])
    return s


def _draw(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = DRAWS, seed: int = 0,
          prompt: list[int] | None = None, output: list[int] | None = None) -> torch.Tensor:
    """Empirical token frequencies from n unseeded rows in one batch (global RNG, seeded here)."""
    torch.manual_seed(seed)
    states = [_state(params, prompt, output) for _ in range(n)]
    out = Sampler([EOS])(logits.expand(n, -1).clone(), states)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.numel()).double() / n


def _chi2_ok(freq: torch.Tensor, probs: torch.Tensor, n: int = DRAWS) -> bool:
    """Pearson chi-square against `probs` at p = 0.001 (Wilson-Hilferty critical value); categories with
    zero expected probability must never appear."""
    probs = probs.double()
    if bool((freq[probs == 0] > 0).any()):
        return False
    keep = probs > 0
    obs, exp = freq[keep] * n, probs[keep] * n
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = int(keep.sum()) - 1
    if df == 0:
        return True
    z = 3.09
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


# ---- distributions ------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature(temperature: float) -> None:
    freq = _draw(SamplingParams(temperature=temperature))
    target = torch.softmax(LOGITS / temperature, -1)
    assert _chi2_ok(freq, target) and _tv(freq, target) < 0.02
    if temperature != 1.0:  # and it really differs from the untempered distribution
        assert not _chi2_ok(freq, torch.softmax(LOGITS, -1))


def test_greedy_takes_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    out = Sampler()(logits, [_state(SamplingParams(temperature=0.0)) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k() -> None:
    freq = _draw(SamplingParams(top_k=3))
    assert float(freq[3:].sum()) == 0.0
    target = torch.zeros(8)
    target[:3] = torch.softmax(LOGITS[:3], -1)
    assert _chi2_ok(freq, target)


def test_top_p_nucleus_exact() -> None:
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log()
    sampler = Sampler()
    for top_p, kept in [(0.35, 1), (0.6, 2), (0.75, 3), (0.9, 4), (0.97, 5), (1.0, 5)]:
        out = sampler.filtered_probs(logits.unsqueeze(0), [_state(SamplingParams(top_p=top_p))])[0]
        assert (out > 0).sum().item() == kept, top_p
        expected = torch.zeros(5)
        expected[:kept] = probs[:kept] / probs[:kept].sum()
        torch.testing.assert_close(out, expected)
    freq = _draw(SamplingParams(top_p=0.75), logits)
    assert _chi2_ok(freq, torch.tensor([0.4, 0.3, 0.15, 0, 0]) / 0.85)


def test_top_k_then_top_p() -> None:
    # top_p applies to the renormalised top-k distribution, as in vLLM
    probs = torch.tensor([0.3, 0.3, 0.2, 0.2])
    out = Sampler().filtered_probs(probs.log().unsqueeze(0), [_state(SamplingParams(top_k=2, top_p=0.4))])[0]
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_min_p() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    out = Sampler().filtered_probs(probs.log().unsqueeze(0), [_state(SamplingParams(min_p=0.25))])[0]
    torch.testing.assert_close(out, torch.tensor([0.5, 0.25, 0.15, 0.0]) / 0.9)
    freq = _draw(SamplingParams(min_p=0.25), probs.log())
    assert freq[3] == 0 and _chi2_ok(freq, torch.tensor([0.5, 0.25, 0.15, 0.0]) / 0.9)


def test_filters_combined_with_temperature() -> None:
    # temperature first, then top_k: top-2 of softmax(l / 0.5)
    freq = _draw(SamplingParams(temperature=0.5, top_k=2))
    target = torch.zeros(8)
    target[:2] = torch.softmax(LOGITS[:2] / 0.5, -1)
    assert _chi2_ok(freq, target)


# ---- penalties and bias: exact transformations --------------------------------------------------------
def test_repetition_penalty_exact() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    s = _state(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[2, 3, 3])
    out = Sampler().process_logits(logits, [s])
    # positive logits divided, negative multiplied; prompt and output tokens alike; others untouched
    torch.testing.assert_close(out, torch.tensor([[1.0, -4.0, 0.5, -2.0, 0.5, 3.0]]))
    assert logits[0, 0] == 2.0  # the caller's tensor is not modified


def test_frequency_and_presence_penalties_exact() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    s = _state(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[4], output=[1, 1, 1, 2])
    out = Sampler().process_logits(logits, [s])
    # output counts {1: 3, 2: 1}; prompt token 4 is not penalised by these two
    torch.testing.assert_close(out, torch.tensor([[1.0, 1 - 1.5 - 0.25, 1 - 0.5 - 0.25, 1.0, 1.0]]))


def test_negative_presence_penalty_encourages() -> None:
    s = _state(SamplingParams(presence_penalty=-1.0), output=[3])
    out = Sampler().process_logits(LOGITS.unsqueeze(0), [s])
    assert out[0, 3] == LOGITS[3] + 1.0


def test_logit_bias_exact() -> None:
    s = _state(SamplingParams(logit_bias={1: 2.5, 6: -100.0, 99: 5.0}))  # 99: outside V, skipped
    out = Sampler().process_logits(LOGITS.unsqueeze(0), [s])
    expected = LOGITS.clone()
    expected[1] += 2.5
    expected[6] -= 100.0
    torch.testing.assert_close(out[0], expected)


def test_penalties_change_samples() -> None:
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5)
    prompt, output = [5], [0, 0, 1]
    freq = _draw(params, prompt=prompt, output=output)
    s = _state(params, prompt, output)
    target = torch.softmax(Sampler().process_logits(LOGITS.unsqueeze(0), [s])[0], -1)
    assert _chi2_ok(freq, target)
    assert not _chi2_ok(freq, torch.softmax(LOGITS, -1))
    assert freq[0] < torch.softmax(LOGITS, -1)[0] / 2


def test_logit_bias_changes_samples() -> None:
    freq = _draw(SamplingParams(logit_bias={7: 5.0, 0: -100.0}))
    biased = LOGITS.clone()
    biased[7] += 5.0
    biased[0] -= 100.0
    assert freq[0] == 0 and _chi2_ok(freq, torch.softmax(biased, -1))
    greedy = Sampler()(LOGITS.unsqueeze(0), [_state(SamplingParams(temperature=0, logit_bias={4: 10.0}))])
    assert greedy.token_ids == [4]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.full((1, 8), -5.0)
    logits[0, EOS] = 10.0
    logits[0, 3] = 9.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    sampler = Sampler([EOS])
    assert sampler(logits, [_state(params, output=[1])]).token_ids != [EOS]
    assert sampler(logits, [_state(params, output=[1])]).token_ids != [3]
    assert sampler(logits, [_state(params, output=[1, 1])]).token_ids == [EOS]
    # even with ignore_eos, min_tokens keeps EOS masked
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler(logits, [_state(ignore, output=[])]).token_ids == [3]
    freq = _draw(SamplingParams(min_tokens=5), logits[0], n=2000)
    assert freq[EOS] == 0 and freq[3] > 0.9


# ---- seeds --------------------------------------------------------------------------------------------
def _seeded_run(params: SamplingParams, others: list[SequenceSamplingState], pos: int, steps: int = 6,
                seed_offset: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(11)
    target = _state(params, seed_offset=seed_offset)
    sampler = Sampler()
    got = []
    for _ in range(steps):
        rows = list(others)
        rows.insert(pos, target)
        logits = torch.randn(len(rows), 40, generator=g)
        logits[pos] = torch.randn(40, generator=torch.Generator().manual_seed(len(got)))  # same every run
        tok = sampler(logits, rows).token_ids[pos]
        target.output_token_ids.append(tok)
        got.append(tok)
    return got


def test_seeded_sampling_independent_of_batch() -> None:
    params = SamplingParams(seed=1234, temperature=1.3, top_k=20, top_p=0.95, repetition_penalty=1.2)
    alone = _seeded_run(params, [], 0)
    torch.manual_seed(99)  # the global RNG state must not matter either
    crowd = [_state(SamplingParams()), _state(SamplingParams(seed=7)), _state(SamplingParams(temperature=0))]
    assert _seeded_run(params, crowd, 2) == alone
    assert _seeded_run(params, crowd[:1], 1) == alone
    assert _seeded_run(params, crowd[1:], 0) == alone


def test_seed_offset_gives_distinct_reproducible_children() -> None:
    params = SamplingParams(seed=5, temperature=1.5)
    a0, a1 = _seeded_run(params, [], 0, 12, 0), _seeded_run(params, [], 0, 12, 1)
    assert a0 != a1
    assert _seeded_run(params, [], 0, 12, 1) == a1


# ---- logprobs -----------------------------------------------------------------------------------------
def test_logprobs_are_raw_top_n_plus_chosen() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(4))
    raw = torch.log_softmax(logits, -1)
    # temperature and top_k do not change the returned logprobs (vLLM returns the raw distribution)
    states = [
        _state(SamplingParams(logprobs=3, temperature=0.3, top_k=5, seed=1)),
        _state(SamplingParams(logprobs=0, temperature=0.0, logit_bias={int(logits[1].argmin()): 100.0})),
        _state(SamplingParams()),
    ]
    out = Sampler()(logits, states)
    lp0, lp1, lp2 = out.logprobs
    assert lp2 is None
    chosen0 = out.token_ids[0]
    top3 = raw[0].topk(3).indices.tolist()
    assert list(lp0)[0] == chosen0 and set(lp0) == set(top3) | {chosen0}
    for t, v in lp0.items():
        assert v == pytest.approx(float(raw[0, t]), abs=1e-6)
    # logprobs=0: only the chosen token, here forced by the bias to the raw argmin
    assert lp1 is not None and list(lp1) == [int(logits[1].argmin())]
    assert lp1[out.token_ids[1]] == pytest.approx(float(raw[1].min()), abs=1e-6)


def test_bad_shapes() -> None:
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, 5), [_state(SamplingParams())])
