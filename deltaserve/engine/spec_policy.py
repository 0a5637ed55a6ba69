"""Adaptive speculation: how many draft tokens each request gets for its next step.

A request whose drafts are accepted at rate a (each draft accepted, given the ones before it were) emits
1 + a + a^2 + ... + a^k tokens from a verify of 1 + k rows, in expectation. Whether that beats plain
decoding depends on the machine: where the weights stream from memory, verifying 1 + k rows costs about
one decode row and k = max pays; where the step is compute-bound (a small model in cache, a large batch)
every extra row costs nearly a decode step and k = 0 is best. So the policy measures both:

- acceptance: per request, exponentially decayed counts of accepted and examined drafts (a draft is
  examined when every draft before it was accepted), shrunk towards the engine-wide rate while the
  request has few of its own;
- cost: the seconds of a step against its row count (trunk forward, verification, sampling, the MTP pass
  that keeps the MTP cache up to date, the rest of the step) and of a draft pass against its row count,
  from the steps the engine actually runs (`MeasuredCosts`).

Each step it gives drafts one at a time to the request whose next draft is most likely to be accepted,
and keeps the allocation with the most expected tokens per second. Only the number of drafts changes:
verification is the same, so greedy output is token-for-token plain greedy and sampled output keeps the
target distribution whatever k it picks. (A seeded sampled request's draws do depend on the k it got, and
the k follows the measured timings, so such a request gets no drafts: SpecDecoder._num_drafts.)
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Protocol

# The clock the costs are measured with: wall time, the time a user waits. (CPU time, used before, counts
# every compute thread's time, spin-waiting included: at 2 threads a step's parallel kernels weighed twice
# its serial Python and a small draft pass's idle threads weighed in full, and adaptive k drafted at batch 8
# where it lost 18% to plain decoding. Load bursts on a shared machine only add wall time, which the cost
# tables' rule below absorbs: a cost falls to a lower measurement at once and rises slowly.)
spec_clock = time.perf_counter

# A request's own counts weigh as much as the engine-wide rate once it has this many examined drafts.
PRIOR_WEIGHT = 4.0
REQUEST_DECAY = 0.95  # per verify step: a request's text changes (code, prose), so recent drafts count more
POOLED_DECAY = 0.995
MAX_RATE = 0.98  # keeps 1 + a + ... + a^k finite-looking and a single lucky run from meaning certainty
# Every EXPLORE_EVERY-th decision is nudged (alternately) one draft up for the request likeliest to accept
# it, or one draft down for every request, so a cost measured once under a burst of other load is measured
# again instead of ruling that size out for good. (Up for one only: a verify of a row per request can cost
# a compute-bound batch two plain steps, and one more row is enough to measure the slope.)
EXPLORE_EVERY = 32
# Drafting must promise this much more tokens per second than plain steps: it has costs the step model
# does not see (the periodic MTP catch-up of requests that postpone it), and a marginal gain is mostly the
# noise of the measurements.
MARGIN = 1.05
# While drafting does not pay at a batch size, the allocation is worked out again only every RECHECK_EVERY-th
# step of that size (the steps between draft nothing, and `idle` says so without looking at the requests):
# working it out costs Python per request, a real share of a small model's decode step, and a few steps'
# delay in starting to draft costs next to nothing.
RECHECK_EVERY = 8
# Requests drop their MTP upkeep (DraftPolicy.quiet) only once this many allocations in a row, at least
# RECHECK_EVERY steps apart, drafted nothing: one noisy measurement must not end a request's drafting.
QUIET_AFTER = 4
# A cost falls to a lower measurement at once and rises by this fraction of the gap: the other jobs on a
# shared machine only ever add time, and a lasting change still shows within a few dozen steps.
RISE = 0.1


@dataclass(slots=True)
class AcceptanceEstimate:
    accepted: float = 0.0
    examined: float = 0.0

    def update(self, num_drafted: int, num_accepted: int, decay: float) -> None:
        # The drafts after the first rejected one were never examined.
        self.accepted = self.accepted * decay + num_accepted
        self.examined = self.examined * decay + num_accepted + (num_accepted < num_drafted)

    def rate(self, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        return min((self.accepted + weight * prior) / (self.examined + weight), MAX_RATE)


class CostTable:
    """Seconds against a row count: piecewise linear between measured counts and on beyond the largest
    with the slope of the last two (no lower than the average slope from the smallest, nor than flat); with
    one count measured, flat (an untried size is assumed as cheap as the measured one, so it gets tried and
    measured). A count measured once is not trusted while others were measured more: a first call often
    includes one-off work (allocation, a first kernel call), and a size that looked dear once would never be
    tried again."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self.count: dict[int, int] = {}
        self._trusted: list[int] = []  # sorted row counts used for lookups

    def record(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        if old is None:
            self.seconds[rows] = seconds
            self.count[rows] = 1
        else:
            self.seconds[rows] = seconds if seconds < old else old + RISE * (seconds - old)
            self.count[rows] += 1
        if self.count[rows] <= 2:  # the trusted set changes only when a count is new or reaches 2
            trusted = [r for r, n in self.count.items() if n >= 2]
            self._trusted = sorted(trusted or self.seconds)

    def trusted(self, rows: int) -> bool:
        return self.count.get(rows, 0) >= 2

    def __call__(self, rows: int) -> float | None:
        """None while nothing is measured."""
        known = self._trusted
        if not known:
            return None
        if self.count.get(rows, 0) >= 2 or len(known) == len(self.seconds) and rows in self.seconds:
            return self.seconds[rows]
        i = bisect.bisect_left(known, rows)
        if i == 0:
            return self.seconds[known[0]]
        if i == len(known):
            if len(known) == 1:
                return self.seconds[known[0]]
            lo, hi, first = known[-2], known[-1], known[0]
            # The last segment's slope, but no less than the average slope from the smallest count: two noisy
            # neighbours (a 13-row step measured cheaper than a 12-row one) must not make every row past them
            # free, or a batch of 8 would draft 24 tokens into a 32-row step priced as a 13-row one.
            slope = max((self.seconds[hi] - self.seconds[lo]) / (hi - lo),
                        (self.seconds[hi] - self.seconds[first]) / (hi - first), 0.0)
            return self.seconds[hi] + slope * (rows - hi)
        lo, hi = known[i - 1], known[i]
        f = (rows - lo) / (hi - lo)
        return self.seconds[lo] + f * (self.seconds[hi] - self.seconds[lo])


class StepCosts(Protocol):
    def step(self, rows: int) -> float | None:
        """Seconds of a step with `rows` rows in its forward, without its draft passes."""

    def step_measured(self, rows: int) -> bool:
        """Whether steps of `rows` rows were measured (enough to trust the figure)."""

    def draft(self, level: int, rows: int) -> float | None:
        """Seconds of draft pass `level` (1: lm_head over the rows MTP pass 1 already ran; 2..k: the MTP
        layer and the lm_head) over `rows` rows."""

    def record_step(self, rows: int, seconds: float) -> None: ...

    def record_draft(self, level: int, rows: int, seconds: float) -> None: ...


@dataclass(slots=True)
class MeasuredCosts:
    """The costs of the steps this engine ran (the engine records them)."""

    steps: CostTable = field(default_factory=CostTable)
    first_draft: CostTable = field(default_factory=CostTable)
    next_draft: CostTable = field(default_factory=CostTable)

    def step(self, rows: int) -> float | None:
        return self.steps(rows)

    def step_measured(self, rows: int) -> bool:
        return self.steps.trusted(rows)

    def draft(self, level: int, rows: int) -> float | None:
        return (self.first_draft if level == 1 else self.next_draft)(rows)

    def record_step(self, rows: int, seconds: float) -> None:
        self.steps.record(rows, seconds)

    def record_draft(self, level: int, rows: int, seconds: float) -> None:
        (self.first_draft if level == 1 else self.next_draft).record(rows, seconds)


class DraftPolicy:
    def __init__(self, max_k: int, adaptive: bool, costs: StepCosts | None = None) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        self.costs: StepCosts = costs if costs is not None else MeasuredCosts()
        self.pooled = AcceptanceEstimate()
        self.num_decisions = 0
        self._idle: dict[int, int] = {}  # batch size -> steps left that draft nothing without deciding
        self._quiet: dict[int, int] = {}  # batch size -> allocations in a row that drafted nothing

    def record_verify(self, request: AcceptanceEstimate, num_drafted: int, num_accepted: int) -> None:
        request.update(num_drafted, num_accepted, REQUEST_DECAY)
        self.pooled.update(num_drafted, num_accepted, POOLED_DECAY)

    def record_no_drafts(self, request: AcceptanceEstimate) -> None:
        """A step in which the request drafted nothing: its own counts fade towards the engine-wide rate,
        so a streak of rejections that stopped its drafting does not stop it for good (it learns nothing
        new while it does not draft)."""
        request.update(0, 0, REQUEST_DECAY)

    def record_step(self, rows: int, seconds: float) -> None:
        self.costs.record_step(rows, seconds)

    def record_draft(self, level: int, rows: int, seconds: float) -> None:
        self.costs.record_draft(level, rows, seconds)

    def rate(self, request: AcceptanceEstimate) -> float:
        prior = self.pooled.rate(0.5, weight=1.0)  # an engine that has verified nothing yet: a coin
        return request.rate(prior)

    def choose(self, rates: list[float], caps: list[int]) -> list[int]:
        """Drafts per request for the next step. caps: the most each may draft (max_k or fewer: max_tokens,
        max_model_len, reserved blocks). Fixed k (adaptive off) drafts the caps."""
        if not self.adaptive or not any(caps):
            # (Nothing may draft, e.g. a request's last token: no decision, and none of the idle steps that a
            # decision that drafting does not pay would start.)
            return list(caps)
        self.num_decisions += 1
        B = len(caps)
        ks = self._best(rates, caps)
        # Nothing pays: the next steps of this size are idle (not while plain steps of this size are still
        # unmeasured: then the zeros say nothing).
        quiet = not any(ks) and self.costs.step_measured(B)
        self._idle[B] = RECHECK_EVERY - 1 if quiet else 0
        self._quiet[B] = self._quiet.get(B, 0) + 1 if quiet else 0
        if self.num_decisions % EXPLORE_EVERY == 0:
            if self.num_decisions % (2 * EXPLORE_EVERY):
                room = [b for b in range(B) if ks[b] < caps[b]]
                if room:
                    ks[max(room, key=lambda b: rates[b] ** (ks[b] + 1))] += 1
            else:
                ks = [max(k - 1, 0) for k in ks]
        return ks

    def idle(self, batch: int) -> bool:
        """Whether this step's `batch` candidates draft nothing without a choose(): the last allocation
        worked out for that many drafted nothing, less than RECHECK_EVERY steps ago, and this is no
        exploration step. True counts as the step's decision."""
        if not self.adaptive or self._idle.get(batch, 0) <= 0 or (self.num_decisions + 1) % EXPLORE_EVERY == 0:
            return False
        self.num_decisions += 1
        self._idle[batch] -= 1
        return True

    def quiet(self, batch: int) -> bool:
        """Whether drafting did not pay the last QUIET_AFTER times it was worked out for steps of `batch`
        candidates (with plain steps of that size measured): then a request that fills a KV block without
        drafting drops its MTP upkeep (SpecDecoder.propose)."""
        return self._quiet.get(batch, 0) >= QUIET_AFTER

    def _best(self, rates: list[float], caps: list[int]) -> list[int]:
        """Greedy: add drafts in order of their acceptance probability (a request's j-th draft counts
        rate^j expected tokens), and keep the prefix with the most expected tokens per second, if that
        beats plain steps by MARGIN."""
        B = len(rates)
        if not self.costs.step_measured(B):
            # Plain steps of this batch are what every choice is weighed against: measure them first (the
            # optimism for untried sizes would otherwise never come back to k = 0).
            return [0] * B
        base = self.costs.step(B)
        # Every (request, j) draft with its expected tokens, most likely first; a request's are in j order.
        order = sorted(
            ((r ** j, b) for b, (r, cap) in enumerate(zip(rates, caps, strict=True)) for j in range(1, cap + 1)),
            key=lambda t: -t[0],
        )
        ks = [0] * B
        per_level = [0] * (self.max_k + 2)  # rows in draft pass j
        tokens, drafting, best, best_n, step = float(B), 0.0, MARGIN * B / base, 0, base
        for n, (gain, b) in enumerate(order, start=1):
            ks[b] += 1
            level = ks[b]
            before = self.costs.draft(level, per_level[level]) if per_level[level] else 0.0
            per_level[level] += 1
            after = self.costs.draft(level, per_level[level])
            measured = self.costs.step(B + n)
            if after is None or measured is None or before is None:
                return list(caps)  # a draft pass never measured: try it
            # More rows never cost less: a noisy table (steps of some sizes measured under more load than
            # others) must not make drafting look free.
            step = max(step, measured)
            drafting += max(after - before, 0.0)
            tokens += gain
            rate = tokens / (step + drafting)
            if rate > best:
                best, best_n = rate, n
        ks = [0] * B
        for _, b in order[:best_n]:
            ks[b] += 1
        return ks
