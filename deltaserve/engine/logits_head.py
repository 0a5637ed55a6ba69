"""LogitsHead: how the engine turns final hidden rows into logits, or straight into greedy tokens. The
runner and the spec decoder share one, so the plain-greedy shortcut lives in one place."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deltaserve.engine.sampler import Sampler, SequenceSamplingState


@dataclass(slots=True)
class LogitsHead:
    # (hidden [N, H], rows or None) -> fp32 logits [R, V]: the executor's compute_logits
    compute_logits: Callable[..., torch.Tensor]
    # Same arguments -> compute_logits(...).argmax(-1): the executor's greedy_tokens (the fused one never
    # builds the logits)
    greedy_tokens: Callable[..., torch.Tensor]
    # (hidden, rows or None, bitmask int32 [R, W]) -> the argmax of the masked logits: the executor's
    # masked_greedy_tokens (the fused one projects only the lm_head panels with an allowed token)
    masked_greedy_tokens: Callable[..., torch.Tensor]

    def plain_argmax(
        self, hidden: torch.Tensor, rows: torch.Tensor | None, states: Sequence[SequenceSamplingState],
        sampler: Sampler,
    ) -> list[int] | None:
        """The argmax token of each row's logits without building them in Python, when every row is plain
        greedy (the sampler's stages would leave its logits as they are), or plain greedy under a grammar
        (structured outputs: only the rows whose grammar refuses their argmax get a masked argmax); else None."""
        if sampler.plain_greedy(states):
            return self.greedy_tokens(hidden, rows).tolist()
        if sampler.grammar_greedy(states):
            def masked_argmax_of(sub: list[int], bitmask: torch.Tensor) -> torch.Tensor:
                index = torch.tensor(sub, dtype=torch.long)
                return self.masked_greedy_tokens(hidden, index if rows is None else rows[index], bitmask)

            return sampler.fix_grammar_argmax(self.greedy_tokens(hidden, rows).tolist(), states, masked_argmax_of)
        return None
