"""The executor interface: how the engine runs the model for one step. Two implementations compute the
same maths: TorchExecutor (the Python model op by op, the reference) and FusedCPUExecutor (one C++ call
per step). make_executor (factory.py) picks one; nothing else in the engine asks which it has."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from deltaserve.model.context import ForwardContext
from deltaserve.ops.token_mask import mask_logits_

Rows = torch.Tensor | list[int] | None  # rows of a hidden-state tensor, or None for every row


class Executor(ABC):
    name: str  # "torch" or "fused-cpu", for logs, metrics and the inspector

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, output_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Final-normed hidden states [T, H] of a step's flat batch; with output_rows (int64 [R], ascending)
        only those rows, [R, H]. Verify segments' per-position GDN states go to ctx.spec_states."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor, rows: Rows = None) -> torch.Tensor:
        """fp32 logits [R, V] of the chosen rows of final-normed hidden states."""

    @abstractmethod
    def greedy_tokens(self, hidden: torch.Tensor, rows: Rows = None) -> torch.Tensor:
        """compute_logits(hidden, rows).argmax(-1), int64 [R]; an executor may do it without the logits."""

    def masked_greedy_tokens(self, hidden: torch.Tensor, rows: Rows, allowed: torch.Tensor) -> torch.Tensor:
        """Greedy tokens under a grammar: the argmax of each chosen row's masked logits (compute_logits masked
        by allowed, int32 [R, ceil(V / 32)]: deltaserve/ops/token_mask.py), int64 [R]; an executor may do it
        without every logit."""
        return mask_logits_(self.compute_logits(hidden, rows), allowed.numpy()).argmax(dim=-1)

    @abstractmethod
    def mtp_hidden(self, next_token_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext, step: int = 0
                   ) -> torch.Tensor:
        """The MTP head's hidden [T, H] from trunk (or previous MTP) hidden at t and token t+1."""

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The vision tower's merged tokens [N, H] for the images' patches (model/vision.py)."""
        raise ValueError(f"the {self.name} executor does not run a vision tower")

    def check_health(self) -> None:
        """Raise if steps can no longer run (a tensor-parallel rank died); one process is always healthy."""
        return None

    def close(self) -> None:
        """Release what the executor started (tensor-parallel workers); nothing for one process."""
        return None

    @abstractmethod
    def commit_verified(self, ctx: ForwardContext, accepted: list[int]) -> None:
        """Each verify segment's GDN slot takes the state after its last accepted position (row accepted[r]
        of ctx.spec_states[layer])."""
