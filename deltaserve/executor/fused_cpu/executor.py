"""FusedCPUExecutor: the Executor interface over the C++ trunk and MTP head (stack.py)."""

from __future__ import annotations

import logging

import torch

from deltaserve.executor.base import Executor, Rows
from deltaserve.executor.fused_cpu.stack import FusedMTP, FusedTrunk
from deltaserve.executor.fused_cpu.vision import FastVisionTower
from deltaserve.model.context import CacheTensors, ForwardContext
from deltaserve.model.decoder import Qwen3_5ForCausalLM

log = logging.getLogger(__name__)


class FusedCPUExecutor(Executor):
    name = "fused-cpu"

    def __init__(self, model: Qwen3_5ForCausalLM, cache: CacheTensors, with_mtp: bool = False) -> None:
        """with_mtp: build the MTP head's C++ stack too (speculative decoding drafts with it)."""
        self.trunk = FusedTrunk(model, cache)
        # Its vision tower (if any) runs once per image, not once per step: a bf16 tower's large calls as torch's
        # bf16 products between the C++ step's kernels, every other call whole in the C++ step
        # (fused_cpu/vision.py).
        self._model = model
        self._vision = None if model.visual is None else FastVisionTower(model.visual)
        self.shard = model.shard  # tensor parallelism: the stacks all-reduce in it; logits are gathered here
        self.vocab_size = model.config.vocab_size
        self._mtp = None
        if with_mtp:
            if len(model.mtp.layers) == 1:
                self._mtp = FusedMTP(model, cache)
            else:  # the C++ stack takes one MTP layer; more draft through the Python model's head
                log.info("the MTP head has %d layers: its draft passes run the Python model",
                         len(model.mtp.layers))
                self._mtp = model.mtp_hidden

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, output_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        return self.trunk(input_ids, ctx, output_rows)

    def compute_logits(self, hidden: torch.Tensor, rows: Rows = None) -> torch.Tensor:
        logits = self.trunk.logits(hidden, rows)
        if self.shard.size == 1:
            return logits
        # Each rank's vocabulary rows side by side, less the padding rows (Qwen3_5ForCausalLM.compute_logits).
        return self.shard.all_gather_last(logits)[:, : self.vocab_size]

    def greedy_tokens(self, hidden: torch.Tensor, rows: Rows = None) -> torch.Tensor:
        if self.shard.size > 1:  # the C++ greedy pass (and its bf16 screen) sees only this rank's rows
            return self.compute_logits(hidden, rows).argmax(dim=-1)
        return self.trunk.greedy_tokens(hidden, rows)

    def masked_greedy_tokens(self, hidden: torch.Tensor, rows: Rows, allowed: torch.Tensor) -> torch.Tensor:
        if self.shard.size > 1:  # each rank holds only its slice of the vocabulary: the gathered logits
            return super().masked_greedy_tokens(hidden, rows, allowed)
        return self.trunk.masked_greedy_tokens(hidden, rows, allowed)

    def mtp_hidden(self, next_token_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, step: int = 0
                   ) -> torch.Tensor:
        if self._mtp is None:
            raise ValueError("this executor was built without the MTP head (with_mtp=False)")
        return self._mtp(next_token_ids, hidden, ctx, step=step)

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        if self._vision is None:
            return self._model.encode_images(pixels, grids)  # its error: the model has no tower
        return self._vision(pixels, grids)

    def commit_verified(self, ctx: ForwardContext, accepted: list[int]) -> None:
        self.trunk.commit_verified(ctx, accepted)
