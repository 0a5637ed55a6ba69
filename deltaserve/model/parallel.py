"""Which tensor-parallel rank a model is, and the collectives its layers call (vLLM's
tensor_model_parallel_all_reduce / all_gather). With one rank every call returns its input untouched, so
the single-process model pays one integer compare per row-parallel projection and nothing else.

A rank's shard runs only inside its executor's calls, where every rank runs the same forward: a collective
outside one (the inspector running rank 0's shard alone) would wait forever for the others, so it raises."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from deltaserve.model.linear import Embedding


class ShardOutsideStepError(RuntimeError):
    """A tensor-parallel shard was run outside its executor, where the other ranks do not join."""


@dataclass(slots=True)
class Shard:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group of the ranks (None: the default group)
    in_step: bool = False  # set by the executor around the calls every rank makes together
    collective_seconds: float = 0.0  # time spent in all-reduce / all-gather (the benchmark reads it)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (the partial outputs of a row-parallel projection)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        self._check()
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.collective_seconds += time.perf_counter() - t0
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x laid side by side along the last axis (vocab-parallel logits)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        self._check()
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        self.collective_seconds += time.perf_counter() - t0
        return torch.cat(parts, dim=-1)

    def _check(self) -> None:
        if not self.in_step:
            raise ShardOutsideStepError(
                f"this model is rank {self.rank} of {self.size} tensor-parallel shards: it runs only through "
                "the engine's tensor-parallel executor, where every rank joins (not alone, e.g. for a trace)"
            )


SINGLE = Shard()  # the whole model in one process; never mutated (size 1 skips every collective)


class VocabParallelEmbedding(Embedding):
    """Rows [rank * per_rank, (rank + 1) * per_rank) of the padded vocabulary; ids of other ranks' rows give
    zeros here, and the all-reduce adds the one rank's row that holds each id (exact: x + 0 = x)."""

    def __init__(self, per_rank: int, hidden_size: int, shard: Shard) -> None:
        super().__init__(per_rank, hidden_size)
        self.shard = shard
        self.start = shard.rank * per_rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = super().forward(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.shard.all_reduce(out)
