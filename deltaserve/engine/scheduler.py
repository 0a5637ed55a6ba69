"""Continuous batching with chunked prefill.

Every step fills one token budget (max_num_batched_tokens) under a sequence cap (max_num_seqs). Running
requests go first: each gets what it still has to compute (one token when decoding, the next chunk when
its prompt is only partly in the cache). Then waiting requests are admitted in arrival order with as much
of their prompt as the budget leaves, so prefill chunks and decode tokens share one forward.

With speculative decoding, a request that samples this step also gets room for the k draft positions the
MTP head will write after it (lookahead slots, as vLLM reserves them), when the pool has it without
preempting anyone.

The scheduler owns the requests' scheduling state: schedule() decides a step, update_from_output() applies
its results (tokens, accepted drafts, the next drafts, computed-token counts, finishes).

When the KV blocks run out, the newest running request is preempted: its blocks and state slot are freed,
it goes back to the front of the queue, and later its prompt plus the tokens it already generated are
recomputed. A request never fails for cache pressure (the engine checks that one max_model_len sequence
fits in the whole cache).

With prefix caching (deltaserve/cache/prefix_cache.py) a request is admitted after the longest prefix
whose KV blocks and GDN snapshot are cached, and prompt chunks end on the request's snapshot points."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deltaserve.cache.manager import CacheManager
from deltaserve.engine.encoder_cache import EncoderCache
from deltaserve.engine.output_processor import OutputProcessor
from deltaserve.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from deltaserve.engine.runner import ModelRunnerOutput

PREFILL = "prefill"
DECODE = "decode"
VERIFY = "verify"  # the token sampled last step plus the MTP drafts after it (speculative decoding)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens of this request in this step's forward
    context_len: int  # tokens already in the cache before this step
    kind: str  # PREFILL (a prompt/recompute chunk), DECODE (the one token sampled last step) or VERIFY
    num_draft_tokens: int = 0  # VERIFY: the drafts among num_tokens (they follow the one real token)

    @property
    def samples(self) -> bool:
        """Whether this step ends the request's pending tokens, so its last row yields a new token."""
        return self.context_len + self.num_tokens - self.num_draft_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_waiting: int
    num_running: int
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def summary(self) -> list[tuple[str, int, str]]:
        """(request_id, num_tokens, kind) per scheduled request, for traces and the inspector."""
        return [(s.request.request_id, s.num_tokens, s.kind) for s in self.scheduled]


class Scheduler:
    def __init__(
        self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int, output: OutputProcessor,
        num_lookahead_tokens: int = 0, encoder_cache: EncoderCache | None = None,
    ) -> None:
        """output: appends tokens and checks stops; num_lookahead_tokens: k with speculation, else 0;
        encoder_cache: the vision tower's outputs, freed here as requests pass their images, are preempted
        or finish."""
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.output = output
        self.num_lookahead_tokens = num_lookahead_tokens
        self.encoder_cache = encoder_cache
        self._encoder_spent = 0  # merged tokens this step's chunks encode so far (reset by schedule())
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the newest is preempted first
        self.num_preemptions = 0
        self.prompt_tokens = 0  # tokens run through the model as prompt/recompute chunks, all steps

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        # The vision tower's budget is max_num_batched_tokens merged tokens a step (vLLM's
        # max_num_encoder_input_tokens default).
        self._encoder_spent = 0
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self.cache.clip_chunk(req.request_id, req.num_computed_tokens, min(req.num_pending_tokens, budget))
            n, encoder_cost = self._clip_for_encoder(req, req.num_computed_tokens, n)
            if n == 0:  # its next image waits for a step with room in the encoder budget
                i += 1
                continue
            drafts = 0
            if req.spec_token_ids and req.num_pending_tokens == 1:
                # Verify 1 + k tokens; drafts beyond the budget are dropped, not postponed (stale next step).
                drafts = min(len(req.spec_token_ids), budget - 1)
                del req.spec_token_ids[drafts:], req.spec_draft_probs[drafts:]
                n = 1 + drafts
            ok = True
            self._reserve_lookahead(req, n, drafts)
            while not self.cache.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    ok = False
                    break
            if not ok:
                break
            scheduled.append(self._entry(req, n, drafts))
            budget -= n
            self._encoder_spent += encoder_cost
            i += 1

        # Nothing new joins while running requests were just evicted for space: they come back first.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            # Prefix caching: start after the longest cached prefix (blocks + GDN snapshot), if any.
            hit = self.cache.lookup_prefix(req)
            start = req.num_computed_tokens + hit.num_tokens
            n = self.cache.clip_chunk(req.request_id, start, min(req.num_tokens - start, budget))
            n, encoder_cost = self._clip_for_encoder(req, start, n)
            if n == 0 or not self.cache.allocate(req.request_id, start + n, hit):
                break
            req.num_computed_tokens = start
            self.cache.admitted(req, hit)
            self._reserve_lookahead(req, n)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.num_cached_tokens = hit.num_tokens
            self.running.append(req)
            scheduled.append(self._entry(req, n))
            budget -= n
            self._encoder_spent += encoder_cost
        return SchedulerOutput(scheduled, len(self.waiting), len(self.running), preempted)

    def _clip_for_encoder(self, req: Request, start: int, n: int) -> tuple[int, int]:
        """The chunk cut before the first image the encoder budget (or cache) has no room for, and its encoder
        cost."""
        if self.encoder_cache is None:
            return n, 0
        return self.encoder_cache.clip_to_budget(req.request_id, start, n, self.max_num_batched_tokens,
                                                 self._encoder_spent)

    def _reserve_lookahead(self, req: Request, n: int, drafts: int = 0) -> None:
        """Room for the draft positions the MTP head writes after a step that samples (it drafts from the
        last valid position t = c + n - 1 at most: positions up to t + k - 1), if the pool has it; with
        less, the spec decoder drafts fewer tokens."""
        k = self.num_lookahead_tokens
        if k and not req.spec_lapsed and req.num_computed_tokens + n - drafts == req.num_tokens:
            want = req.num_computed_tokens + n + k - 1
            if self.cache.blocks_needed(req.request_id, want):  # most steps have the room already
                self.cache.allocate(req.request_id, want)

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[Request]:
        """Apply a step's results: computed-token counts (a verify keeps its real token and the accepted
        drafts), the new tokens with their stop checks (a request may finish inside an accepted run), and
        the drafts for the next step. Returns the requests that got tokens."""
        now = time.monotonic()
        speculating = self.num_lookahead_tokens > 0
        for s in sched.scheduled:
            req = s.request
            if s.kind == VERIFY:
                # The real token and the accepted drafts are in the cache; later rows are stale.
                req.num_computed_tokens += 1 + out.verified[req.request_id].num_accepted
            else:
                req.num_computed_tokens += s.num_tokens
                if s.kind != DECODE:
                    self.prompt_tokens += s.num_tokens
                    if self.encoder_cache is not None:
                        self.encoder_cache.release_done(req.request_id, req.num_computed_tokens)
            if speculating:
                req.spec_token_ids, req.spec_draft_probs = out.drafts.get(req.request_id, ([], []))
        # Prefix caching: snapshots and newly full blocks, before a finishing request frees its blocks.
        self.cache.after_step([(s.request, s.context_len) for s in sched.scheduled])
        # The runner's rows follow the scheduled order: verify results by id, sampled tokens in turn.
        sampled = iter(()) if out.sampled is None else zip(out.sampled.token_ids, out.sampled.logprobs, strict=True)
        touched = []
        for s in sched.scheduled:
            req = s.request
            v = out.verified.get(req.request_id) if s.kind == VERIFY else None
            if v is not None:
                tokens, logprobs = v.token_ids, v.logprobs
            elif s.samples:
                token, lp = next(sampled)
                tokens, logprobs = [token], [lp]
            else:
                continue
            if req.is_finished:  # aborted between schedule() and now
                continue
            status = self.output.append_run(req, tokens, logprobs, now)
            if status is not None:
                self.finish(req, status)
            touched.append(req)
        return touched

    @staticmethod
    def _entry(req: Request, n: int, drafts: int = 0) -> ScheduledRequest:
        if drafts:
            return ScheduledRequest(req, n, req.num_computed_tokens, VERIFY, drafts)
        # A single token that finishes the pending work is a decode step (for a fresh 1-token prompt too).
        # (A 1-token slice of a preempted request's recomputation leaves work pending: that is a prefill.)
        kind = DECODE if n == req.num_pending_tokens == 1 else PREFILL
        return ScheduledRequest(req, n, req.num_computed_tokens, kind)

    def _preempt(self, req: Request) -> None:
        self.cache.free(req.request_id)
        if self.encoder_cache is not None:
            self.encoder_cache.drop_outputs(req.request_id)
        req.spec_token_ids.clear()  # drafts are proposed afresh once the request is recomputed
        req.spec_draft_probs.clear()
        # The recomputation runs the MTP pass over every position again.
        req.spec_backlog, req.spec_held, req.spec_lapsed = 0, [], False
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire req (stopped, length or aborted) from wherever it is and free its cache."""
        req.status = status
        req.spec_token_ids, req.spec_draft_probs = [], []
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.free(req.request_id)
        if self.encoder_cache is not None:
            self.encoder_cache.remove(req.request_id)
