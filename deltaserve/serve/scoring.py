"""Prompt logprobs (echo with logprobs, `prompt_logprobs`, scoring with max_tokens 0): the log-probability
of every prompt token given the ones before it, and the top-k at each position.

The engine samples from the last position of a prompt only, so the scores come from a forward of their own:
stateless (no engine cache is read or written, as the inspector's traces), in a worker thread, one at a
time (it competes with serving for the same cores), logits built a chunk of rows at a time."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import torch

from deltaserve.model.context import ForwardContext

_LOGIT_ROWS = 256  # [rows, vocab] fp32 at a time: 256 MB for a 248k vocabulary


@dataclass(slots=True)
class TokenScore:
    """One prompt position: the token's logprob and 1-based rank, and the top-k {token id: logprob}."""

    logprob: float
    rank: int
    top: dict[int, float]


class PromptScorer:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._lock = threading.Lock()

    async def score(self, ids: list[int], top_k: int) -> list[TokenScore | None]:
        """Per prompt token (None for the first, which nothing predicts), off the event loop."""
        return await asyncio.to_thread(self._locked_score, ids, top_k)

    def _locked_score(self, ids: list[int], top_k: int) -> list[TokenScore | None]:
        with self._lock:
            return score_prompt(self.model, ids, top_k)


@torch.inference_mode()
def score_prompt(model: torch.nn.Module, ids: list[int], top_k: int) -> list[TokenScore | None]:
    hidden = model(torch.tensor(ids, dtype=torch.long), ForwardContext.stateless([len(ids)]))
    targets = torch.tensor(ids[1:], dtype=torch.long)
    scores: list[TokenScore | None] = [None]
    for start in range(0, len(ids) - 1, _LOGIT_ROWS):
        rows = hidden[start : start + _LOGIT_ROWS][: len(ids) - 1 - start]  # position t predicts token t+1
        logprobs = model.compute_logits(rows).float().log_softmax(-1)
        wanted = targets[start : start + rows.shape[0]]
        chosen = logprobs.gather(1, wanted[:, None])[:, 0]
        ranks = (logprobs > chosen[:, None]).sum(-1) + 1
        top_v, top_i = logprobs.topk(top_k, dim=-1) if top_k else (None, None)
        for r in range(rows.shape[0]):
            top = {} if top_i is None else dict(zip(top_i[r].tolist(), top_v[r].tolist(), strict=True))
            scores.append(TokenScore(float(chosen[r]), int(ranks[r]), top))
    return scores
