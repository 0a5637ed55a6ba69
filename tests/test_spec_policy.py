"""Adaptive k's choices from given acceptance rates and step costs (deltaserve/engine/spec_policy.py): all
drafts where extra rows are nearly free, none where every row costs a decode row, more drafts for the
requests more likely to accept them, and cost tables that try what they have not measured."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from deltaserve.engine.spec_policy import (
    EXPLORE_EVERY,
    MARGIN,
    QUIET_AFTER,
    RECHECK_EVERY,
    AcceptanceEstimate,
    CostTable,
    DraftPolicy,
    MeasuredCosts,
)
from tests.spec_costs import COMPUTE_BOUND, MEMORY_BOUND, FixedCosts


def policy(costs, max_k: int = 3) -> DraftPolicy:
    return DraftPolicy(max_k, adaptive=True, costs=costs)


def test_memory_bound_steps_draft_the_most_and_compute_bound_steps_none() -> None:
    assert policy(MEMORY_BOUND).choose([0.7] * 8, [3] * 8) == [3] * 8
    assert policy(COMPUTE_BOUND).choose([0.7] * 8, [3] * 8) == [0] * 8
    # The caps (max_tokens, max_model_len, reserved blocks) bound what is chosen.
    assert policy(MEMORY_BOUND).choose([0.7, 0.7], [1, 0]) == [1, 0]


def test_likelier_requests_get_more_drafts() -> None:
    # One step of 4 rows costs 1 + 0.25 per extra row: a draft pays when its acceptance odds beat that.
    costs = FixedCosts(fixed=1.0, per_row=0.25, per_draft_row=0.0)
    ks = policy(costs).choose([0.95, 0.75, 0.1, 0.05], [3] * 4)
    assert ks == [3, 1, 0, 0]


def test_the_best_k_follows_the_acceptance_and_the_cost_of_a_row() -> None:
    # At batch 1, k drafts emit 1 + a + ... + a^k tokens for 1 + k rows: the policy picks the k that
    # maximises tokens per second, if that beats plain decoding by the margin.
    for a in (0.3, 0.6, 0.9):
        for per_row in (0.05, 0.3, 0.8):
            costs = FixedCosts(fixed=1.0 - per_row, per_row=per_row, per_draft_row=0.05)
            speed = [sum(a**j for j in range(k + 1)) / (1.0 + per_row * k + 0.05 * k) for k in range(4)]
            best = max(range(4), key=speed.__getitem__)
            want = best if speed[best] > MARGIN * speed[0] else 0
            assert policy(costs).choose([a], [3]) == [want], (a, per_row)
    assert policy(FixedCosts(fixed=0.95, per_row=0.05, per_draft_row=0.0)).choose([0.9], [3]) == [3]


def test_fixed_k_always_drafts_the_caps() -> None:
    fixed = DraftPolicy(3, adaptive=False, costs=COMPUTE_BOUND)
    assert fixed.choose([0.0, 0.9], [3, 2]) == [3, 2]


def test_unmeasured_costs_measure_plain_steps_first_then_try_drafting() -> None:
    p = policy(MeasuredCosts())
    assert p.choose([0.5], [3]) == [0]  # plain steps of this batch are the yardstick
    p.record_step(1, 0.010)
    p.record_step(1, 0.010)
    assert p.choose([0.5], [3]) == [3]  # a verify never measured is assumed as cheap as the nearest
    p.record_step(4, 0.040)
    p.record_step(4, 0.040)
    for level in (1, 2, 3):
        p.record_draft(level, 1, 0.001)
        p.record_draft(level, 1, 0.001)
    assert p.choose([0.5], [3]) == [0]  # measured: 4 rows cost 4 decode rows


def test_exploration_nudges_every_so_many_decisions() -> None:
    p = policy(COMPUTE_BOUND)
    picks = [p.choose([0.7], [3]) for _ in range(2 * EXPLORE_EVERY)]
    assert picks.count([1]) == 1 and picks.count([0]) == 2 * EXPLORE_EVERY - 1
    # In a batch, one more draft for the likeliest request (enough to measure one more row), not one each.
    p = policy(COMPUTE_BOUND)
    picks = [p.choose([0.6, 0.9, 0.7], [3, 3, 3]) for _ in range(EXPLORE_EVERY)]
    assert picks[-1] == [0, 1, 0] and not any(map(any, picks[:-1]))


@dataclass(slots=True)
class NoisyCosts(FixedCosts):
    """Steps of `cheap` rows measured at `seconds`, below what fewer rows cost (other load at other times)."""

    cheap: int = 0
    seconds: float = 0.0

    def step(self, rows: int) -> float:
        return self.seconds if rows == self.cheap else FixedCosts.step(self, rows)


def test_more_rows_never_cost_less_than_fewer() -> None:
    # 8 rows cost 1.0 and 10 rows 2.0, but 9 rows were measured at 0.6: one draft at acceptance 0.3 then
    # looks like 8.3 tokens in 0.6 s. As at least the 8-row cost, it does not pay.
    costs = NoisyCosts(fixed=-3.0, per_row=0.5, per_draft_row=0.0, cheap=9, seconds=0.6)
    assert policy(costs).choose([0.3] * 8, [1] * 8) == [0] * 8


def test_noisy_neighbours_do_not_make_rows_past_them_free() -> None:
    """Costs as a 2-thread engine measures them on the widened demo, but for the 9-row steps, measured (noise)
    cheaper than the 8-row ones. Flat beyond 9 rows, a 32-row verify looked as cheap as a 9-row step and a
    batch of 8 drafted 3 each, in a step that costs 3.5 plain ones; on the average slope from 1 row it
    drafts where the table says a row costs less than the tokens it brings."""
    costs = MeasuredCosts()
    for rows, ms in {1: 12.5, 2: 12.8, 3: 13.5, 4: 15.6, 8: 29.7, 9: 28.9}.items():
        costs.record_step(rows, ms / 1e3)
        costs.record_step(rows, ms / 1e3)
    for level, ms in ((1, 0.99), (2, 0.78)):
        costs.record_draft(level, 1, ms / 1e3)
        costs.record_draft(level, 1, ms / 1e3)
    assert costs.step(32) == pytest.approx((28.9 + 23 * (28.9 - 12.5) / 8) / 1e3)
    assert policy(costs).choose([0.45] * 8, [3] * 8) == [0] * 8
    assert policy(costs).choose([0.77], [3]) == [3], "one request still drafts (1 -> 4 rows: +25%)"


def test_where_drafting_does_not_pay_the_allocation_is_rechecked_every_few_steps() -> None:
    """Working the allocation out costs Python per request: where it came out empty, the next steps of that
    batch size are idle (they draft nothing, and nobody looks at the requests) until the recheck, which then
    sees new costs; exploration steps still decide."""
    p = policy(COMPUTE_BOUND)
    assert p.choose([0.7] * 4, [3] * 4) == [0] * 4
    assert [p.idle(4) for _ in range(RECHECK_EVERY)] == [True] * (RECHECK_EVERY - 1) + [False]
    assert not p.idle(2)  # another batch size decides for itself
    p.costs = MEMORY_BOUND
    assert p.choose([0.7] * 4, [3] * 4) == [3] * 4
    assert not p.idle(4)
    p = policy(COMPUTE_BOUND)
    decided = 0
    for _ in range(EXPLORE_EVERY):
        if not p.idle(1):
            decided += 1
            picked = p.choose([0.7], [3])
    assert picked == [1], "the exploration step decided (and nudged)"
    assert decided == -(-(EXPLORE_EVERY - 1) // RECHECK_EVERY) + 1


def test_a_step_where_nothing_may_draft_is_no_decision() -> None:
    """A request's last token leaves it no room for drafts (caps 0): that says nothing about whether drafting
    pays, so it must not make the next steps idle. (It did: at batch 1 each request's end made the next 7
    steps plain, 56 plain steps beside 214 verify steps for eight 64-token requests on the widened demo.)"""
    p = policy(MEMORY_BOUND)
    assert p.choose([0.7], [0]) == [0]
    assert not p.idle(1) and not p.quiet(1)
    assert p.choose([0.7], [3]) == [3]


def test_requests_drop_their_mtp_upkeep_only_after_several_quiet_allocations() -> None:
    p = policy(COMPUTE_BOUND)
    for _ in range(QUIET_AFTER):
        assert not p.quiet(4), "one noisy allocation must not end drafting"
        assert p.choose([0.7] * 4, [3] * 4) == [0] * 4
        while p.idle(4):
            pass
    assert p.quiet(4) and not p.quiet(2)
    p.costs = MEMORY_BOUND
    p.choose([0.7] * 4, [3] * 4)
    assert not p.quiet(4)


def test_cost_table_trusts_repeated_measurements_and_takes_the_lower() -> None:
    t = CostTable()
    assert t(3) is None
    t.record(1, 1.0)
    t.record(1, 1.0)
    t.record(8, 50.0)  # once: maybe a first call's one-off work
    assert t(8) == 1.0 and not t.trusted(8)
    t.record(8, 2.0)  # the lower of two measurements, at once
    assert t.trusted(8) and t(8) == 2.0
    assert t(4) == pytest.approx(1.0 + 3 / 7)  # linear between measured counts
    assert t(10) == pytest.approx(2.0 + 2 / 7)  # beyond them on the last segment's slope
    t.record(9, 1.5)
    t.record(9, 1.5)
    # a falling last segment (noise) neither falls on nor goes flat: the average slope from the smallest count
    assert t(20) == pytest.approx(1.5 + 11 * 0.5 / 8)
    t.record(8, 12.0)  # a higher one rises by a tenth of the gap (other jobs only ever add time)
    assert t(8) == pytest.approx(3.0)


def test_acceptance_estimate_counts_the_examined_drafts() -> None:
    e = AcceptanceEstimate()
    e.update(num_drafted=3, num_accepted=1, decay=1.0)  # the second is rejected, the third never examined
    e.update(num_drafted=3, num_accepted=3, decay=1.0)
    assert (e.accepted, e.examined) == (4, 5)
    assert e.rate(prior=0.5, weight=0.0) == pytest.approx(0.8)
    assert AcceptanceEstimate().rate(prior=0.3) == pytest.approx(0.3)  # nothing of its own: the prior


def test_a_request_that_stopped_drafting_drifts_back_to_the_engine_rate() -> None:
    p = policy(MEMORY_BOUND)
    for _ in range(20):
        p.record_verify(AcceptanceEstimate(), 3, 3)  # the engine's other requests accept everything
    mine = AcceptanceEstimate()
    for _ in range(10):
        p.record_verify(mine, 3, 0)
    low = p.rate(mine)
    assert low < 0.3
    for _ in range(40):
        p.record_no_drafts(mine)
    assert p.rate(mine) > 2 * low
