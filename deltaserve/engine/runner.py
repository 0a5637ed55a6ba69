"""ModelRunner: turns one SchedulerOutput into one forward over a flat [T] batch, and samples only the
rows that need a token (the last row of every request whose pending tokens all ran this step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.cache.manager import CacheManager
from deltaserve.engine.sampler import Sampler, SamplerOutput
from deltaserve.engine.scheduler import SchedulerOutput
from deltaserve.model.context import CacheTensors, ForwardContext
from deltaserve.model.decoder import Qwen3_5ForCausalLM


@dataclass(slots=True)
class ModelRunnerOutput:
    request_ids: list[str]  # the requests that got a token, in row order
    sampled: SamplerOutput | None


class ModelRunner:
    def __init__(
        self, model: Qwen3_5ForCausalLM, cache: CacheTensors, manager: CacheManager, sampler: Sampler
    ) -> None:
        self.model = model
        self.cache = cache
        self.manager = manager
        self.sampler = sampler
        self.block_size = manager.block_size

    def build_context(self, sched: SchedulerOutput) -> tuple[torch.Tensor, ForwardContext]:
        """input_ids [T] and the paged context, built with tensor ops rather than a per-token loop."""
        entries = sched.scheduled
        ids: list[int] = []
        query_lens, context_lens, slots, tables = [], [], [], []
        for s in entries:
            req = s.request
            ids.extend(req.token_slice(s.context_len, s.context_len + s.num_tokens))
            query_lens.append(s.num_tokens)
            context_lens.append(s.context_len)
            slots.append(self.manager.state_slots[req.request_id])
            tables.append(self.manager.block_tables[req.request_id])
        B = len(entries)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)  # [B, W]
        qlens = torch.tensor(query_lens, dtype=torch.long)
        T = int(qlens.sum())
        seq_of_token = torch.repeat_interleave(torch.arange(B), qlens, output_size=T)  # [T]
        starts = torch.cumsum(qlens, 0) - qlens  # [B]
        positions = torch.arange(T) - starts[seq_of_token] + torch.tensor(context_lens)[seq_of_token]
        bs = self.block_size
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        ctx = ForwardContext(
            positions=positions,
            query_start_loc=qsl,
            context_lens=context_lens,
            cache=self.cache,
            block_tables=block_tables,
            state_slots=torch.tensor(slots, dtype=torch.long),
            slot_mapping=slot_mapping,
        )
        return torch.tensor(ids, dtype=torch.long), ctx

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        input_ids, ctx = self.build_context(sched)
        hidden = self.model(input_ids, ctx)  # [T, H]
        rows, states, request_ids = [], [], []
        for b, s in enumerate(sched.scheduled):
            if s.samples:
                rows.append(ctx.query_start_loc[b + 1] - 1)
                states.append(s.request.sampling)
                request_ids.append(s.request.request_id)
        if not rows:
            return ModelRunnerOutput([], None)
        logits = self.model.compute_logits(hidden, torch.tensor(rows, dtype=torch.long))  # [N, V] fp32
        return ModelRunnerOutput(request_ids, self.sampler(logits, states))
