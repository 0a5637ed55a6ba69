"""The reference executor: the Python model (deltaserve/model), op by op. Runs every dtype, every cache
dtype and traced forwards; several times slower than the fused step on a CPU."""

from __future__ import annotations

import torch

from deltaserve.executor.base import Executor, Rows
from deltaserve.model.context import CacheTensors, ForwardContext
from deltaserve.model.decoder import Qwen3_5ForCausalLM


class TorchExecutor(Executor):
    name = "torch"

    def __init__(self, model: Qwen3_5ForCausalLM, cache: CacheTensors) -> None:
        self.model = model
        self.cache = cache

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, output_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        hidden = self.model(input_ids, ctx)
        return hidden if output_rows is None else hidden[output_rows]

    def compute_logits(self, hidden: torch.Tensor, rows: Rows = None) -> torch.Tensor:
        return self.model.compute_logits(hidden, rows)

    def greedy_tokens(self, hidden: torch.Tensor, rows: Rows = None) -> torch.Tensor:
        return self.model.compute_logits(hidden, rows).argmax(dim=-1)

    def mtp_hidden(self, next_token_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, step: int = 0
                   ) -> torch.Tensor:
        return self.model.mtp_hidden(next_token_ids, hidden, ctx, step)

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        return self.model.encode_images(pixels, grids)

    def commit_verified(self, ctx: ForwardContext, accepted: list[int]) -> None:
        slots = ctx.state_slots[ctx.spec_seqs]
        pick = torch.tensor(accepted, dtype=torch.long)
        rows = torch.arange(len(accepted))
        for layer_id, (conv_states, ssm_states) in ctx.spec_states.items():
            conv_cache, ssm_cache = self.cache.conv[layer_id], self.cache.ssm[layer_id]
            conv_cache[slots] = conv_states[rows, pick].to(conv_cache.dtype)
            ssm_cache[slots] = ssm_states[rows, pick].to(ssm_cache.dtype)
