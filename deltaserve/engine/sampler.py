"""Turns the logits of the positions that need a token into tokens, one row per sequence, following vLLM's
order of processing:

    logit_bias -> min_tokens (mask EOS / stop ids) -> penalties -> grammar mask (structured outputs)
    -> [greedy: argmax]
    -> temperature -> top_k -> top_p -> min_p -> sample

Logprobs are those of the raw model distribution (log_softmax of the logits as they came in), as vLLM
returns by default. A seeded sequence draws only from its own generator, so its tokens do not depend on
which other sequences share the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from deltaserve.engine.structured import (
    CompiledGrammar,
    GrammarMatcher,
    apply_grammar_masks,
    compute_masks_ahead,
    refused_rows,
    row_masks,
)
from deltaserve.engine.threads import physical_cores
from deltaserve.sampling import SamplingParams

# Exponential draws of exactly 0 would turn p/q into inf (or nan for p = 0); this floor keeps the race fair.
_TINY = 1e-20
# Below this many grammar rows the worker thread's handoff (tens of microseconds) costs more than the masks
# (a few microseconds each) it would hide.
_MASKS_AHEAD_MIN_ROWS = 4


@dataclass(slots=True)
class SequenceSamplingState:
    """What the sampler needs to know about one sequence; the engine appends each sampled token to
    `output_token_ids` (the penalties and min_tokens read it)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    grammar: GrammarMatcher | None = None  # structured outputs: this sequence's matcher


def make_sampling_state(
    params: SamplingParams, prompt_token_ids: Sequence[int], seed_offset: int = 0,
    grammar: CompiledGrammar | None = None,
) -> SequenceSamplingState:
    """A seeded request gets its own CPU generator seeded with seed + seed_offset (the engine passes the
    child index for n > 1, so siblings differ but every run repeats); unseeded requests share the global
    RNG."""
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device="cpu")
        # torch seeds must be non-negative 64-bit; wrap any Python int into that range.
        generator.manual_seed((params.seed + seed_offset) % (1 << 63))
    return SequenceSamplingState(
        params=params, generator=generator, prompt_token_ids=list(prompt_token_ids),
        grammar=grammar.matcher() if grammar is not None else None,
    )


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row: None when the request asked for no logprobs; else {token: logprob} with the chosen token first,
    # then the top-N of the raw distribution (the chosen token appears once).
    logprobs: list[dict[int, float] | None]


def validate_params_for_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Checks the token ids a request names against the vocabulary; call it when a request is added, so a
    bad id is a 400 for that request and never reaches the sampler (which skips such ids defensively)."""
    for name, ids in (
        ("logit_bias", list((params.logit_bias or {}).keys())),
        ("stop_token_ids", list(params.stop_token_ids or [])),
    ):
        for t in ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"{name} names token id {t}, outside the vocabulary [0, {vocab_size})")


class Sampler:
    def __init__(self, eos_token_ids: Iterable[int] | int | None = None) -> None:
        if eos_token_ids is None:
            eos_token_ids = []
        elif isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        self.eos_token_ids: list[int] = list(eos_token_ids)
        self._grammar_worker: ThreadPoolExecutor | None = None  # started by the first structured request
        self._cores: int | None = None  # physical cores this process may use, read once

    def grammar_masks_ahead(self, states: Sequence[SequenceSamplingState]) -> Future | None:
        """Start syncing the grammar matchers of `states` (rows to be sampled, one per sequence) and computing
        their masks on a worker thread, to overlap the forward; None when fewer than _MASKS_AHEAD_MIN_ROWS
        rows have a grammar, or when the forward's threads use every core. The caller waits for the result
        (wait_grammar_masks) before sampling these rows, and touches their matchers only after that."""
        rows = [s for s in states if s.grammar is not None]
        if len(rows) < _MASKS_AHEAD_MIN_ROWS or not self._spare_core():
            return None  # the sampler computes the masks itself, when it needs them
        if self._grammar_worker is None:
            self._grammar_worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._grammar_worker.submit(
            compute_masks_ahead, [s.grammar for s in rows], [s.output_token_ids for s in rows]
        )

    def _spare_core(self) -> bool:
        """Whether a core is left over by the forward's threads. Without one the worker would take a core
        from them, and the others spin at their barriers meanwhile (measured with 2 threads on 2 cores under
        load, batch 32: constrained steps took 2.5x the CPU of plain ones with the worker, about as much
        without it)."""
        if self._cores is None:
            self._cores = physical_cores()
        return torch.get_num_threads() < self._cores

    @staticmethod
    def wait_grammar_masks(pending: Future | None) -> None:
        """Wait for grammar_masks_ahead's work (re-raising what failed there); a no-op for None."""
        if pending is not None:
            pending.result()

    def __call__(self, logits: torch.Tensor, states: Sequence[SequenceSamplingState]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be [N, V] with N = {len(states)} states, got {tuple(logits.shape)}"
            )
        logits = logits.float()
        if self.plain_greedy(states):
            # the common all-greedy batch: nothing to process, nothing to copy
            return SamplerOutput(token_ids=logits.argmax(dim=-1).tolist(), logprobs=[None] * len(states))
        want_logprobs = [s.params.logprobs is not None for s in states]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        processed = self.process_logits(logits, states)
        greedy = [s.params.greedy for s in states]
        tokens = torch.empty(len(states), dtype=torch.long)
        g_rows = [i for i, g in enumerate(greedy) if g]
        r_rows = [i for i, g in enumerate(greedy) if not g]
        if g_rows:
            tokens[g_rows] = processed[g_rows].argmax(dim=-1)
        if r_rows:
            sub_states = [states[i] for i in r_rows]
            probs = self.filtered_probs(processed[r_rows], sub_states)
            tokens[r_rows] = _sample(probs, [s.generator for s in sub_states])

        token_list = tokens.tolist()
        out_logprobs: list[dict[int, float] | None] = []
        for i, s in enumerate(states):
            if not want_logprobs[i]:
                out_logprobs.append(None)
                continue
            assert raw_logprobs is not None
            row = raw_logprobs[i]
            entry = {token_list[i]: float(row[token_list[i]])}
            n = min(s.params.logprobs or 0, row.shape[0])
            if n:
                vals, ids = row.topk(n)
                for t, v in zip(ids.tolist(), vals.tolist(), strict=True):
                    entry.setdefault(t, v)
            out_logprobs.append(entry)
        return SamplerOutput(token_ids=token_list, logprobs=out_logprobs)

    def plain_greedy(self, states: Sequence[SequenceSamplingState]) -> bool:
        """Whether every row's token is the argmax of its raw logits (greedy, no logprobs, nothing that
        process_logits would change)."""
        return all(s.params.greedy and s.params.logprobs is None and not self._modifies(s) for s in states)

    def _modifies(self, s: SequenceSamplingState) -> bool:
        """Whether process_logits would change this sequence's row."""
        return s.grammar is not None or self._modifies_besides_grammar(s)

    @staticmethod
    def _modifies_besides_grammar(s: SequenceSamplingState) -> bool:
        p = s.params
        return bool(p.logit_bias) or len(s.output_token_ids) < p.min_tokens or has_penalties(p)

    # ---- greedy rows under a grammar, without their logits ---------------------------------------------
    def grammar_greedy(self, states: Sequence[SequenceSamplingState]) -> bool:
        """Whether every row is plain greedy but for a grammar: then a row's token is its raw argmax
        whenever its grammar allows that token (masking cannot change an argmax it keeps)."""
        return any(s.grammar is not None for s in states) and all(
            s.params.greedy and s.params.logprobs is None and not self._modifies_besides_grammar(s)
            for s in states
        )

    def fix_grammar_argmax(
        self, tokens: list[int], states: Sequence[SequenceSamplingState],
        masked_argmax_of: Callable[[list[int], torch.Tensor], torch.Tensor],
    ) -> list[int]:
        """tokens: each row's raw argmax (grammar_greedy states). Rows whose grammar refuses their token get
        the argmax of their masked logits, masked_argmax_of(rows, bitmask int32 [len(rows), W]) (the
        executor's masked_greedy_tokens); the others keep theirs."""
        rows = [i for i, s in enumerate(states) if s.grammar is not None]
        grammars = [states[i].grammar for i in rows]
        masks = row_masks(grammars, [states[i].output_token_ids for i in rows])
        refused = refused_rows(masks, [tokens[i] for i in rows])
        if refused:
            bitmask = np.stack([masks[r] for r in refused])  # stop ids allowed as the grammar's end (the masks)
            fixed = masked_argmax_of([rows[r] for r in refused], torch.from_numpy(bitmask)).tolist()
            for r, t in zip(refused, fixed, strict=True):
                tokens[rows[r]] = t
        return tokens

    # ---- stages (public so speculative decoding can build the same target distribution) ----------------
    def process_logits(self, logits: torch.Tensor, states: Sequence[SequenceSamplingState]) -> torch.Tensor:
        """logit_bias, min_tokens masking, penalties and grammar masks; returns a new tensor, the input is
        untouched."""
        logits = logits.float().clone()
        vocab = logits.shape[1]
        for i, s in enumerate(states):
            p = s.params
            if p.logit_bias:
                ids = [t for t in p.logit_bias if 0 <= t < vocab]
                if ids:
                    bias = torch.tensor([float(p.logit_bias[t]) for t in ids], dtype=logits.dtype)
                    logits[i, ids] += bias
            if len(s.output_token_ids) < p.min_tokens:
                # EOS is masked even with ignore_eos: min_tokens promises that many non-stop tokens.
                banned = [t for t in (*self.eos_token_ids, *(p.stop_token_ids or [])) if 0 <= t < vocab]
                if banned:
                    logits[i, banned] = float("-inf")
        _apply_penalties(logits, states)
        rows = [i for i, s in enumerate(states) if s.grammar is not None]
        if rows:
            apply_grammar_masks(
                logits, rows, [states[i].grammar for i in rows], [states[i].output_token_ids for i in rows],
                [states[i].params.greedy for i in rows],
            )
        return logits

    def filtered_probs(self, logits: torch.Tensor, states: Sequence[SequenceSamplingState]) -> torch.Tensor:
        """Temperature, then top_k, top_p, min_p: the distribution a non-greedy row samples from, [N, V]."""
        temps = torch.tensor([max(s.params.temperature, 1e-5) for s in states], dtype=logits.dtype)
        logits = logits / temps.unsqueeze(1)
        top_k = [s.params.top_k for s in states]
        top_p = [s.params.top_p for s in states]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _apply_top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([s.params.min_p for s in states], dtype=probs.dtype)
        if bool((min_p > 0).any()):
            # min_p only compares each probability with the row's maximum, so renormalising is unnecessary
            # for the decision; the surviving mass is renormalised below.
            threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _apply_penalties(logits: torch.Tensor, states: Sequence[SequenceSamplingState]) -> None:
    rows = [i for i, s in enumerate(states) if has_penalties(s.params)]
    if not rows:
        return
    vocab = logits.shape[1]
    sub = logits[rows]  # [R, V]
    counts = torch.zeros_like(sub)  # output-token counts per row
    seen = torch.zeros(sub.shape, dtype=torch.bool)  # prompt or output token, for the repetition penalty
    for r, i in enumerate(rows):
        out = torch.tensor([t for t in states[i].output_token_ids if 0 <= t < vocab], dtype=torch.long)
        prompt = torch.tensor([t for t in states[i].prompt_token_ids if 0 <= t < vocab], dtype=torch.long)
        if out.numel():
            counts[r].index_add_(0, out, torch.ones(out.numel(), dtype=counts.dtype))
            seen[r, out] = True
        if prompt.numel():
            seen[r, prompt] = True
    rep = torch.tensor([states[i].params.repetition_penalty for i in rows], dtype=sub.dtype).unsqueeze(1)
    freq = torch.tensor([states[i].params.frequency_penalty for i in rows], dtype=sub.dtype).unsqueeze(1)
    pres = torch.tensor([states[i].params.presence_penalty for i in rows], dtype=sub.dtype).unsqueeze(1)
    # Repetition penalty (CTRL / HF / vLLM): shrink positive logits by division, push negative ones down by
    # multiplication, over prompt AND output tokens.
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    # OpenAI penalties over generated tokens only.
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    logits[rows] = sub


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks (to -inf) all but the k largest logits, then all but the smallest set of the remaining tokens
    whose renormalised probability reaches top_p (the token that crosses top_p is kept)."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], dtype=torch.long)
    ranks = torch.arange(vocab).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks.unsqueeze(1), float("-inf"))
    # top_p = 1 must keep everything, even where rounding lets the cumulative sum reach 1 early.
    ps = torch.tensor([p if p < 1.0 else 2.0 for p in top_p], dtype=logits.dtype).unsqueeze(1)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= ps
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def _sample(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p. Each seeded row draws its own q from
    its own generator, so its result is independent of the rest of the batch."""
    q = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        q[unseeded] = torch.empty(len(unseeded), probs.shape[1], dtype=probs.dtype).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            q[i] = torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=g)
    return (probs / q.clamp_min(_TINY)).argmax(dim=-1)
