"""MTP speculative decoding: draft k tokens with the model's MTP head, verify them in the next step's
flat forward, accept exactly (greedy: while draft == target argmax; sampling: rejection sampling).

Position bookkeeping (one request; x_i is token i of prompt + output, h_t the trunk's final-normed hidden
at position t, i.e. after reading x_0..x_t):

- The MTP entry for trunk position t reads (h_t, x_{t+1}), sits at rotary position t and keeps its K/V
  in the MTP layer's paged cache at position t (same block table as the trunk). Its output predicts x_{t+2}.
- Invariant after every step: MTP entries 0 .. num_computed_tokens-1 are valid (made from trunk hiddens
  and real tokens), exactly the positions whose trunk K/V and GDN state the cache holds; except that with
  adaptive k a request drafting nothing may postpone the entries of its last L positions, all inside its
  last, partly filled KV block (Request.spec_backlog = L, spec_held their trunk hiddens), and runs them
  in the MTP pass 1 of the step in which it drafts again or fills that block. If it fills the block while
  the policy finds that drafting does not pay at its batch size (a compute-bound model), it drops the
  upkeep instead (Request.spec_lapsed): it runs no more MTP entries and drafts no more, so such steps cost
  what plain ones do. Its later blocks hold stale MTP K/V; a request that reuses them from the prefix cache
  drafts worse there, never wrongly (verification decides every token).
- After a step in which positions [c, c+n) became valid (a prompt chunk: n = chunk; a decode: n = 1; a
  verify of 1+m tokens with a drafts accepted: n = 1+a), MTP pass 1 runs those n entries (tokens
  x_{c+1} .. x_{c+n}; the last is the token sampled this step, or the next prompt token mid-prefill),
  which restores the invariant. Its last row, t = c+n-1, drafts d_1: the token at position c+n+1, right
  after x_{c+n}, the one just sampled.
- Draft pass j = 2..k feeds pass j-1's output hidden and d_{j-1} at position t+j-1 (context t+j-1). Those
  entries are speculative: the next step's pass 1 rewrites every one of them that ends up accepted before
  anything reads it, and the ones past the accepted length are rewritten before the sequence grows
  that far (attention reads only positions < its sequence length).
- The verify step feeds x_{n-1} (the last sampled token, at position n-1 where n = num_tokens) and
  d_1..d_m at positions n-1 .. n-1+m. Row i's target distribution decides d_{i+1}; row m gives the bonus.
  With a accepted, positions n-1 .. n-1+a become valid; the GDN slots take the state after row a and the
  trunk K/V of later rows are stale until overwritten.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deltaserve.cache.manager import CacheManager
from deltaserve.engine.logits_head import LogitsHead
from deltaserve.engine.request import Request
from deltaserve.engine.sampler import Sampler, SequenceSamplingState, _sample, has_penalties
from deltaserve.engine.spec_policy import DraftPolicy, spec_clock
from deltaserve.executor import Executor
from deltaserve.model.context import ForwardContext


@dataclass(slots=True)
class DraftEntry:
    """One scheduled request as the MTP pass sees it after the step, before the scheduler applies it."""

    seq: int  # its sequence index in the step's ForwardContext
    context_len: int
    num_valid: int  # positions context_len .. context_len + num_valid - 1 became valid this step
    tokens: list[int]  # the token after each of them
    request: Request
    emitted: list[int] | None  # the tokens this step emits for it (to draft after), None if it drafts none

    @property
    def num_valid_after(self) -> int:
        return self.context_len + self.num_valid


@dataclass(slots=True)
class VerifyResult:
    token_ids: list[int]  # accepted drafts, then the target's own token (correction or bonus)
    logprobs: list[dict[int, float] | None]
    num_drafted: int
    num_accepted: int


def _state_at(s: SequenceSamplingState, extra: list[int]) -> SequenceSamplingState:
    """The sampling state as it would be with `extra` tokens already generated (penalties, min_tokens, the
    grammar's position); s itself where nothing reads the generated tokens (it copies none of them)."""
    p = s.params
    if not extra or s.grammar is None and len(s.output_token_ids) >= p.min_tokens and not has_penalties(p):
        return s
    return dataclasses.replace(s, output_token_ids=s.output_token_ids + extra)  # keeps the grammar matcher


def _logprob_entry(row: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """The sampler's format: the chosen token first, then the top-n of the raw distribution."""
    entry = {token: float(row[token])}
    if n:
        vals, ids = row.topk(min(n, row.shape[0]))
        for t, v in zip(ids.tolist(), vals.tolist(), strict=True):
            entry.setdefault(t, v)
    return entry


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


# A step's hidden of at most this many rows (a decode step's) is kept whole by the requests that postpone
# their MTP entries, for up to a block of steps; of a larger one (with prompt chunks) they copy their rows.
_HOLD_WHOLE_ROWS = 64


class SpecDecoder:
    def __init__(
        self, executor: Executor, manager: CacheManager, sampler: Sampler, num_speculative_tokens: int,
        max_model_len: int, head: LogitsHead, policy: DraftPolicy | None = None,
    ) -> None:
        """executor: draft passes (mtp_hidden) and the verified GDN state commit; head: its lm_head;
        policy: how many drafts each request gets (default: always num_speculative_tokens)."""
        self.executor = executor
        self.mtp_hidden = executor.mtp_hidden
        self.manager = manager
        self.sampler = sampler
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.head = head
        self.policy = policy if policy is not None else DraftPolicy(num_speculative_tokens, adaptive=False)
        # Seconds (spec_clock) of the last propose()'s drafting (adaptive k only): the engine prices the rest of a
        # step apart, against its row count.
        self.draft_seconds = 0.0

    # ---- verification -----------------------------------------------------------------------------------
    def verify(
        self, hidden: torch.Tensor, ctx: ForwardContext, seqs: Sequence[int], requests: Sequence[Request]
    ) -> list[VerifyResult]:
        """seqs: the verify sequences of ctx (ctx.spec_seqs order). Accepts or rejects each request's
        drafts against the target distribution of every verified row, built by the sampler's own stages
        with the state each row would have seen without speculation, then commits the GDN state of the
        last accepted position."""
        rows: list[int] = []
        states: list[SequenceSamplingState] = []
        for b, req in zip(seqs, requests, strict=True):
            start = ctx.query_start_loc[b]
            drafts = req.spec_token_ids
            for i in range(len(drafts) + 1):
                rows.append(start + i)
                states.append(_state_at(req.sampling, drafts[:i]))
        row_index = torch.tensor(rows, dtype=torch.long)
        want_lp = [r.params.logprobs is not None for r in requests]
        targets = self.head.plain_argmax(hidden, row_index, states, self.sampler)  # all plain greedy
        if targets is None:
            logits = self.head.compute_logits(hidden, row_index)  # [R, V]
            processed = self.sampler.process_logits(logits, states)
            raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        else:
            raw_lp = None  # plain greedy rows want no logprobs

        results: list[VerifyResult] = []
        r0 = 0
        for req, lp_wanted in zip(requests, want_lp, strict=True):
            drafts = req.spec_token_ids
            m = len(drafts)
            block = slice(r0, r0 + m + 1)
            if req.params.greedy:
                target = targets[block] if targets is not None else processed[block].argmax(dim=-1).tolist()
                a = 0
                while a < m and drafts[a] == target[a]:
                    a += 1
                tokens = drafts[:a] + [target[a]]
            else:
                tokens = self._rejection_sample(req, processed[block], states[block])
                a = len(tokens) - 1
            logprobs: list[dict[int, float] | None] = [None] * len(tokens)
            if lp_wanted and raw_lp is not None:
                n = req.params.logprobs or 0
                logprobs = [_logprob_entry(raw_lp[r0 + i], t, n) for i, t in enumerate(tokens)]
            results.append(VerifyResult(tokens, logprobs, m, a))
            self.policy.record_verify(req.spec_acceptance, m, a)
            r0 += m + 1
        self._commit_gdn_states(ctx, [r.num_accepted for r in results])
        return results

    def _rejection_sample(
        self, req: Request, processed: torch.Tensor, states: list[SequenceSamplingState]
    ) -> list[int]:
        """Leviathan et al.: accept d_i with probability min(1, p(d_i)/q(d_i)); at the first rejection draw
        from normalised max(p - q, 0); with every draft accepted draw the bonus from p. The emitted tokens
        are then distributed exactly as sampling from p alone."""
        p = self.sampler.filtered_probs(processed, states)  # [m+1, V]
        gen = req.sampling.generator
        drafts = req.spec_token_ids
        out: list[int] = []
        for i, (d, q) in enumerate(zip(drafts, req.spec_draft_probs, strict=True)):
            if _uniform(gen) * float(q[d]) < float(p[i, d]):
                out.append(d)
                continue
            residual = (p[i] - q).clamp_min(0.0)
            total = float(residual.sum())
            # total == 0 means p == q, where rejection has probability 0; only rounding gets here.
            dist = residual / total if total > 0 else p[i]
            out.append(int(_sample(dist[None], [gen])[0]))
            return out
        out.append(int(_sample(p[len(drafts)][None], [gen])[0]))
        return out

    def _commit_gdn_states(self, ctx: ForwardContext, accepted: list[int]) -> None:
        if not ctx.spec_states:
            return
        self.executor.commit_verified(ctx, accepted)
        ctx.spec_states.clear()  # the per-position states are large; drop them now

    # ---- drafting ---------------------------------------------------------------------------------------
    def propose(
        self, hidden: torch.Tensor, ctx: ForwardContext, entries: Sequence[DraftEntry], make_context,
    ) -> dict[str, tuple[list[int], list]]:
        """Runs MTP pass 1 over the positions that became valid this step, then up to k-1 draft passes for
        the requests that draft (as many as the policy gives each). Returns each drafting request's drafts
        and the distributions they were drawn from (None for greedy ones). make_context(query_lens,
        context_lens, request_ids) builds a paged ForwardContext.

        A request that the adaptive policy gives no drafts skips pass 1: it keeps its trunk hidden rows
        (Request.spec_held; spec_backlog counts them) and runs them in the pass of a later step, when it drafts
        again or when its trunk fills a KV block (so every full block, which the prefix cache may hand to
        another request, holds its MTP K/V). Where speculation does not pay, that leaves one MTP pass per
        block instead of one per step, and a step where nobody drafts or fills a block runs no MTP pass
        and copies nothing. Where drafting did not pay at this batch size (policy.quiet), a request that
        fills a block without drafting drops its MTP upkeep for good (Request.spec_lapsed)."""
        self.draft_seconds = 0.0
        policy = self.policy
        candidates = [e for e in entries if e.emitted is not None]
        budget: dict[int, int] = {}  # id(entry) -> its drafts, for those that draft
        if policy.idle(len(candidates)):  # adaptive k, where drafting did not pay a few steps ago
            for e in candidates:
                if not e.request.spec_lapsed:
                    policy.record_no_drafts(e.request.spec_acceptance)
        else:
            rates = [policy.rate(e.request.spec_acceptance) for e in candidates] if policy.adaptive else []
            chosen = policy.choose(rates, [self._num_drafts(e) for e in candidates])
            for e, k in zip(candidates, chosen, strict=True):
                if k:
                    budget[id(e)] = k
                elif policy.adaptive and not e.request.spec_lapsed:
                    policy.record_no_drafts(e.request.spec_acceptance)
        lapse = policy.quiet(len(candidates))
        bs = self.manager.block_size
        # This step's hidden is the executor's own tensor: a small one is held as it is by the requests that
        # postpone, a large one (with prompt chunks) only by the copies of their rows.
        small = hidden.shape[0] <= _HOLD_WHOLE_ROWS
        tokens: list[int] = []
        segments: list[tuple[torch.Tensor, int, int]] = []  # pass 1's hidden input: (tensor, first row, rows)
        any_held = False
        qlens, clens, rids = [], [], []
        drafters: list[DraftEntry] = []
        last_rows: list[int] = []
        budgets: list[int] = []
        for e in entries:
            req = e.request
            if req.spec_lapsed:
                continue
            start = ctx.query_start_loc[e.seq]
            num_held = req.spec_backlog
            mtp_valid = e.context_len - num_held
            k = budget.get(id(e), 0)
            postpone = policy.adaptive and k == 0 and e.emitted is not None
            if postpone and mtp_valid >= e.num_valid_after // bs * bs:
                # No drafts and no block filled: postpone this step's MTP entries (all in the last block).
                n = e.num_valid
                req.spec_held.append((hidden, start, n) if small else (hidden[start:start + n].clone(), 0, n))
                req.spec_backlog = num_held + n
                continue
            if postpone and lapse:
                # A block filled while drafting does not pay at this batch size: drop the MTP upkeep.
                req.spec_held, req.spec_backlog, req.spec_lapsed = [], 0, True
                continue
            if num_held:
                segments.extend(req.spec_held)
                any_held = True
                tokens.extend(req.token_slice(mtp_valid + 1, e.context_len + 1))  # known by now
                req.spec_held, req.spec_backlog = [], 0
            segments.append((hidden, start, e.num_valid))
            tokens.extend(e.tokens)
            qlens.append(num_held + e.num_valid)
            clens.append(mtp_valid)
            rids.append(req.request_id)
            if k > 0:
                drafters.append(e)
                last_rows.append(len(tokens) - 1)
                budgets.append(k)
        if not tokens:
            return {}
        # Adaptive k prices drafting: pass 1 (which a request that does not draft may postpone) and the
        # draft passes, in seconds of spec_clock.
        timing = policy.adaptive and bool(drafters)
        pass1_started = spec_clock() if timing else 0.0
        mctx = make_context(qlens, clens, rids)
        h_in = self._pass1_input(hidden, segments, len(tokens), any_held)
        h = self.mtp_hidden(torch.tensor(tokens, dtype=torch.long), h_in, mctx)  # [N, H]
        if not drafters:
            return {}
        pass1 = spec_clock() - pass1_started if timing else 0.0
        if len(last_rows) < h.shape[0]:
            h = h[last_rows]
        drafts: dict[str, tuple[list[int], list]] = {e.request.request_id: ([], []) for e in drafters}
        active = drafters  # the entries still drafting; h has one row per entry
        for j in range(self.k):
            started = spec_clock() if timing else 0.0
            if j > 0:
                keep = [p for p, b in enumerate(budgets) if b > j]
                if not keep:
                    break
                if len(keep) < len(active):
                    active = [active[p] for p in keep]
                    budgets = [budgets[p] for p in keep]
                    h = h[keep]
                # Pass j+1: the entry for position t+j (t = last valid position), fed the previous pass's
                # hidden and draft; it attends to the MTP entries 0 .. t+j.
                ids = [e.request.request_id for e in active]
                dctx = make_context([1] * len(active), [e.num_valid_after - 1 + j for e in active], ids)
                prev = torch.tensor([drafts[r][0][-1] for r in ids], dtype=torch.long)
                h = self.mtp_hidden(prev, h, dctx, step=j)
            self._sample_drafts(active, h, drafts)
            if timing:
                seconds = spec_clock() - started + (pass1 if j == 0 else 0.0)
                self.draft_seconds += seconds
                policy.record_draft(j + 1, len(active), seconds)
        return drafts

    @staticmethod
    def _pass1_input(hidden: torch.Tensor, segments: list[tuple[torch.Tensor, int, int]], n: int, any_held: bool
                     ) -> torch.Tensor:
        """Pass 1's hidden input [n, H], the segments' rows one after another: this step's hidden itself when
        that is every row of it, else one gather (or, with postponed rows of earlier steps, one cat)."""
        if any_held:
            return torch.cat([t[s:s + m] for t, s, m in segments])
        if n == hidden.shape[0]:  # every row, in order
            return hidden
        rows = [r for _, s, m in segments for r in range(s, s + m)]
        return hidden[torch.tensor(rows, dtype=torch.long)]

    def _num_drafts(self, e: DraftEntry) -> int:
        """k, or fewer: no more than the request may still emit minus the target's own token, no position
        at or past max_model_len, and no draft position past the blocks the scheduler reserved. Zero for a
        seeded sampled request under adaptive k: the drafts a request verifies change which draws its
        generator makes, and adaptive k's choice follows the machine's timings, so its tokens would not
        repeat from run to run as a seed promises."""
        req = e.request
        if req.spec_lapsed or (self.policy.adaptive and req.params.seed is not None and not req.params.greedy):
            return 0
        k = self.k
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - len(req.output_token_ids) - len(e.emitted) - 1)
        k = min(k, self.max_model_len - req.num_tokens - len(e.emitted))
        t = e.num_valid_after - 1  # the last valid position; draft pass j writes position t+j-1
        have = len(self.manager.block_tables[req.request_id]) * self.manager.block_size
        return max(min(k, have - t), 0)

    def _sample_drafts(
        self, ents: list[DraftEntry], hidden: torch.Tensor, drafts: dict[str, tuple[list[int], list]]
    ) -> None:
        """One draft token per request from the logits of its MTP hidden row, processed with the request's
        own parameters (so drafts resemble the target); sampled drafts keep the distribution they were
        drawn from."""
        reqs = [e.request for e in ents]
        mine = [drafts[r.request_id] for r in reqs]
        states = [_state_at(r.sampling, e.emitted + d[0]) for r, e, d in zip(reqs, ents, mine, strict=True)]
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        random = [i for i, r in enumerate(reqs) if not r.params.greedy]
        tokens = self.head.plain_argmax(hidden, None, states, self.sampler)  # all plain greedy: no logits
        if tokens is None:
            processed = self.sampler.process_logits(self.head.compute_logits(hidden), states)
            tokens = processed[greedy].argmax(dim=-1).tolist() if greedy else []
        for i, t in zip(greedy, tokens, strict=True):
            mine[i][0].append(t)
            mine[i][1].append(None)
        if random:
            sub = [states[i] for i in random]
            probs = self.sampler.filtered_probs(processed[random], sub)
            drawn = _sample(probs, [s.generator for s in sub]).tolist()
            for r, i in enumerate(random):
                mine[i][0].append(drawn[r])
                mine[i][1].append(probs[r])
