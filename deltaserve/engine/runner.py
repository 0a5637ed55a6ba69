"""ModelRunner: turns one SchedulerOutput into one forward over a flat [T] batch, and samples only the
rows that need a token (the last row of every request whose pending tokens all ran this step); with
speculation, verify rows go to the SpecDecoder, which then drafts for the next step. It keeps nothing
between calls: everything a step yields is in its ModelRunnerOutput, which the scheduler applies."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.cache.manager import CacheManager
from deltaserve.engine.encoder_cache import EncoderCache
from deltaserve.engine.logits_head import LogitsHead
from deltaserve.engine.sampler import Sampler, SamplerOutput
from deltaserve.engine.scheduler import VERIFY, SchedulerOutput
from deltaserve.engine.spec_decode import DraftEntry, SpecDecoder, VerifyResult
from deltaserve.executor import Executor
from deltaserve.model.context import CacheTensors, ForwardContext
from deltaserve.model.mrope import positions_for

# Steps with at most this many tokens build positions and KV slots in a Python loop (measured at 32
# tokens: 19 us against 50 us for the tensor ops, which win from about a hundred tokens on).
_LOOP_TOKENS = 64


@dataclass(slots=True)
class ModelRunnerOutput:
    request_ids: list[str]  # the requests that got a token, in row order
    sampled: SamplerOutput | None
    verified: dict[str, VerifyResult] = field(default_factory=dict)  # speculating requests' tokens
    # The next step's drafts per request: (token ids, the distribution each was drawn from or None)
    drafts: dict[str, tuple[list[int], list]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self, executor: Executor, cache: CacheTensors, manager: CacheManager, sampler: Sampler,
        head: LogitsHead, spec: SpecDecoder | None = None, encoder_cache: EncoderCache | None = None,
    ) -> None:
        """head: the executor's lm_head (shared with the spec decoder); encoder_cache: the requests' images
        and the vision tower's output for them (a model with a vision tower)."""
        self.executor = executor
        self.head = head
        self.cache = cache
        self.manager = manager
        self.sampler = sampler
        self.block_size = manager.block_size
        self.spec = spec
        self.encoder_cache = encoder_cache

    def build_context(self, sched: SchedulerOutput) -> tuple[torch.Tensor, ForwardContext]:
        """input_ids [T] and the paged context; a verify entry feeds its last sampled token and drafts."""
        ids: list[int] = []
        for s in sched.scheduled:
            req = s.request
            end = s.context_len + s.num_tokens - s.num_draft_tokens
            ids.extend(req.token_slice(s.context_len, end))
            if s.kind == VERIFY:
                ids.extend(req.spec_token_ids)
        ctx = self.make_context(
            [s.num_tokens for s in sched.scheduled],
            [s.context_len for s in sched.scheduled],
            [s.request.request_id for s in sched.scheduled],
            [s.kind == VERIFY for s in sched.scheduled] if self.spec is not None else None,
        )
        if self.encoder_cache is not None and self.encoder_cache.prompts:
            spans = [(s.request.request_id, s.context_len, s.num_tokens - s.num_draft_tokens, ctx.query_start_loc[b])
                     for b, s in enumerate(sched.scheduled)]
            ctx.mm_embeds = self.encoder_cache.embeddings_for(spans, self.executor.encode_images)
        return torch.tensor(ids, dtype=torch.long), ctx

    def make_context(
        self, query_lens: list[int], context_lens: list[int], request_ids: list[str],
        verify: list[bool] | None = None,
    ) -> ForwardContext:
        """A paged context over the requests' block tables and state slots, built with tensor ops rather
        than a per-token loop (the MTP passes reuse it with the same tables)."""
        tables = [self.manager.block_tables[r] for r in request_ids]
        slots = [self.manager.state_slots[r] for r in request_ids]
        B = len(request_ids)
        width = max(len(t) for t in tables)
        flat: list[int] = []
        for t in tables:
            flat += t
            flat += [0] * (width - len(t))
        block_tables = torch.tensor(flat, dtype=torch.long).view(B, width)  # [B, W]
        T = sum(query_lens)
        bs = self.block_size
        if T <= _LOOP_TOKENS:  # decode steps: a Python loop is cheaper than a dozen small tensor ops
            pos: list[int] = []
            kv_slots: list[int] = []
            for q, c, t in zip(query_lens, context_lens, tables):
                for p in range(c, c + q):
                    pos.append(p)
                    kv_slots.append(t[p // bs] * bs + p % bs)
            positions = torch.tensor(pos, dtype=torch.long)
            slot_mapping = torch.tensor(kv_slots, dtype=torch.long)
        else:
            qlens = torch.tensor(query_lens, dtype=torch.long)
            seq_of_token = torch.repeat_interleave(torch.arange(B), qlens, output_size=T)  # [T]
            starts = torch.cumsum(qlens, 0) - qlens  # [B]
            positions = torch.arange(T) - starts[seq_of_token] + torch.tensor(context_lens)[seq_of_token]
            slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        if self.encoder_cache is not None and any(r in self.encoder_cache.prompts for r in request_ids):
            positions = self._mrope_positions(positions, qsl, request_ids)
        return ForwardContext(
            positions=positions,
            query_start_loc=qsl,
            context_lens=list(context_lens),
            cache=self.cache,
            block_tables=block_tables,
            state_slots=torch.tensor(slots, dtype=torch.long),
            slot_mapping=slot_mapping,
            verify=verify,
        )

    def _mrope_positions(self, positions: torch.Tensor, qsl: list[int], request_ids: list[str]) -> torch.Tensor:
        """[T] token indices -> [3, T] mRoPE positions: a request with images reads its prompt's (t, h, w)
        positions and shifts later tokens by its delta; text-only requests keep index on all three rows."""
        out = positions.expand(3, -1).clone()
        for b, rid in enumerate(request_ids):
            prompt = self.encoder_cache.prompts.get(rid)
            if prompt is not None:
                rows = slice(qsl[b], qsl[b + 1])
                out[:, rows] = positions_for(prompt.positions, prompt.delta, positions[rows])
        return out

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        input_ids, ctx = self.build_context(sched)
        rows, states, request_ids = [], [], []
        verify_seqs, verify_reqs = [], []
        for b, s in enumerate(sched.scheduled):
            if s.kind == VERIFY:
                verify_seqs.append(b)
                verify_reqs.append(s.request)
            elif s.samples:
                rows.append(ctx.query_start_loc[b + 1] - 1)
                states.append(s.request.sampling)
                request_ids.append(s.request.request_id)
        # None: every row samples (a decode-only step), and the heads take hidden as it is, without a copy
        row_index = None if len(rows) == len(input_ids) else torch.tensor(rows, dtype=torch.long)
        # Structured outputs: the sampled rows' grammar masks are computed while the model runs
        masks_ahead = self.sampler.grammar_masks_ahead(states)
        try:
            hidden, row_index = self._forward(input_ids, ctx, row_index)
        finally:
            self.sampler.wait_grammar_masks(masks_ahead)
        verified: dict[str, VerifyResult] = {}
        if verify_seqs:
            assert self.spec is not None
            results = self.spec.verify(hidden, ctx, verify_seqs, verify_reqs)
            verified = {r.request_id: v for r, v in zip(verify_reqs, results, strict=True)}
        out = ModelRunnerOutput(request_ids, None, verified)
        if rows:
            out.sampled = self._sample(hidden, row_index, states)
        if self.spec is not None:
            if any(not s.request.spec_lapsed for s in sched.scheduled):
                out.drafts = self.spec.propose(hidden, ctx, self._draft_entries(sched, out), self.make_context)
            else:  # every request dropped its MTP upkeep: nothing to run or draft
                self.spec.draft_seconds = 0.0
        return out

    def _forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, row_index: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final hidden rows, and the row index that selects the sampled ones among them."""
        if self.spec is None and row_index is not None:
            # Only the sampled rows' hidden states are read (without speculation, whose MTP pass and verify
            # read every row): the fused step's last layer skips the rest of its work for the others.
            return self.executor.forward(input_ids, ctx, row_index), None  # [len(rows), H], the rows in order
        return self.executor.forward(input_ids, ctx), row_index  # [T, H]

    def _sample(self, hidden: torch.Tensor, row_index: torch.Tensor | None, states: list) -> SamplerOutput:
        tokens = self.head.plain_argmax(hidden, row_index, states, self.sampler)
        if tokens is not None:  # the argmax the sampler would take, without the logits
            return SamplerOutput(tokens, [None] * len(tokens))
        logits = self.head.compute_logits(hidden, row_index)  # [N, V] fp32
        return self.sampler(logits, states)

    @staticmethod
    def _draft_entries(sched: SchedulerOutput, out: ModelRunnerOutput) -> list[DraftEntry]:
        """What the MTP pass needs of every scheduled request: the positions that became valid this step
        and the tokens after them, including the ones this step emitted (not yet in the request)."""
        sampled = {}
        if out.sampled is not None:
            sampled = dict(zip(out.request_ids, out.sampled.token_ids, strict=True))
        entries = []
        for b, s in enumerate(sched.scheduled):
            req, c = s.request, s.context_len
            v = out.verified.get(req.request_id)
            if v is not None:  # the real token and the accepted drafts; then the correction or bonus
                emitted = v.token_ids
                entries.append(DraftEntry(b, c, 1 + v.num_accepted, emitted, req, emitted))
            elif req.request_id in sampled:
                emitted = [sampled[req.request_id]]
                tokens = req.token_slice(c + 1, c + s.num_tokens) + emitted
                entries.append(DraftEntry(b, c, s.num_tokens, tokens, req, emitted))
            else:  # mid-prefill: the next prompt tokens are known, and nothing is drafted
                tokens = req.token_slice(c + 1, c + s.num_tokens + 1)
                entries.append(DraftEntry(b, c, s.num_tokens, tokens, req, None))
        return entries
