"""Structured outputs through llguidance: a request's StructuredOutputsParams compiles to one grammar, each
sequence gets a matcher over it, and the sampler masks every token the matcher cannot take.

The engine was picked by measuring, on the demo's 8192-token vocabulary with one thread, a step's masks
(compute + consume) for a JSON schema: llguidance 1.9.1 25 us at batch 1 and 424 us at batch 32, xgrammar
0.2.8 4 us and 178 us, outlines-core 0.2.14 27 ms. xgrammar computes masks faster, but it needs
transformers and triton at run time; llguidance installs alone, takes Lark and GBNF grammars (vLLM's
`grammar` field) and regexes directly, and rolls back, which speculative decoding needs. Its mask cost
matters less than the raw numbers say, because most greedy rows never need a mask (below).

Matchers follow the sequence lazily: before each mask the matcher is synced to the tokens the sampler is
asked about (rolling back what differs, then consuming the new ones). So the engine needs no hook when a
token is accepted, and speculative decoding works unchanged: the verify rows of one request sync the
matcher one draft further each, and the next step rolls back the rejected drafts. A draft the grammar
rejects leaves the rows after it unmasked; they are never used, because the row before masks that draft
(greedy argmax cannot pick it, rejection sampling accepts it with probability 0).

A greedy row whose raw argmax the grammar allows keeps it: masking cannot change an argmax it keeps. Only
the rows whose grammar refuses their argmax get the argmax of their masked logits (Sampler.fix_grammar_argmax,
the executor's masked_greedy_tokens: the fused step projects only the lm_head panels that hold an allowed
token, usually a handful where the model's own choice was refused).

The runner hides the grammar's work behind the forward: while the model runs (without the GIL), a worker
thread syncs every sampled row's matcher and computes its mask in one batched llguidance call
(compute_masks_ahead; llguidance drops the GIL too). A matcher keeps that mask while its tokens do not
change, so after the forward, checking an argmax is a bit lookup."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from deltaserve.ops.token_mask import mask_logits_
from deltaserve.sampling import StructuredOutputsParams

_CACHED_GRAMMARS = 64
# JSON without free whitespace: with flexible whitespace a model can pad forever, and OpenAI's own
# structured outputs look like json.dumps (", " and ": ").
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema, regex or grammar llguidance cannot compile; the message says which and why."""


def llguidance_module() -> Any:
    import llguidance  # imported on first use: plain requests never pay for it

    return llguidance


def lark_text(tokenizer: Any, text: str) -> str:
    """`text` as a Lark terminal: an added token (`</think>`, `<tool_call>` in Qwen vocabularies) is one
    token that llguidance names `<[id]>`; anything else is a quoted literal."""
    tid = tokenizer.token_to_id(text) if tokenizer is not None else None
    if tid is not None and tid in tokenizer.added_token_ids:
        return f"<[{tid}]>"
    return json.dumps(text)


def json_schema_lark(schema: dict[str, Any] | bool) -> str:
    """A Lark expression for one JSON value of `schema` (the compact whitespace above)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    merged = dict(schema)
    merged["x-guidance"] = {**_JSON_OPTIONS, **schema.get("x-guidance", {})}
    return "%json " + json.dumps(merged)


def _body_lark(spec: StructuredOutputsParams) -> str:
    """The constraint's own Lark grammar (a `start` rule)."""
    llg = llguidance_module()
    if spec.json is not None:
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict | bool):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return "start: " + json_schema_lark(schema)
    if spec.json_object:
        return "start: " + json_schema_lark({"type": "object"})
    if spec.regex is not None:
        return f"start: /{llg.regex_to_lark(spec.regex)}/"
    if spec.choice is not None:
        return "start: " + " | ".join(json.dumps(c) for c in spec.choice)
    assert spec.grammar is not None
    if "::=" in spec.grammar:  # GBNF (llama.cpp / xgrammar EBNF): convert, as vLLM's llguidance backend does
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            return gbnf_to_lark(spec.grammar)
        except Exception as e:  # its converter raises its own error types
            raise GrammarError(f"the GBNF grammar does not convert: {e}") from e
    return spec.grammar


def _what(spec: StructuredOutputsParams) -> str:
    for name in ("json", "regex", "choice", "grammar"):
        if getattr(spec, name) is not None:
            return {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}[name]
    return "json_object"


@dataclass(slots=True)
class CompiledGrammar:
    """A grammar checked against the tokenizer; matcher() gives each sequence its own, a copy of a fresh
    prototype (copying measured cheaper than building a matcher from the grammar, ~0.5 ms)."""

    grammar: str
    lltokenizer: Any
    stop_ids: tuple[int, ...] = ()  # the engine's other ids that end a sequence (GrammarMatcher.stop_ids)
    _prototype: Any = None

    def matcher(self) -> GrammarMatcher:
        if self._prototype is None:
            self._prototype = llguidance_module().LLMatcher(self.lltokenizer, self.grammar, log_level=0)
        return GrammarMatcher(self._prototype.deep_copy(), self.lltokenizer.eos_token, self.lltokenizer.vocab_size,
                              self.stop_ids)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer (its llguidance token trie is built once)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lltokenizer: Any = None
        # Requests often repeat a schema (one client, one tool set): compiled grammars are kept, a few.
        # The server compiles on its request threads (to name the field in a 400), the engine on its own.
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def lltokenizer(self) -> Any:
        if self._lltokenizer is None:
            if self.tokenizer is None:
                raise GrammarError("structured outputs need the model's tokenizer, and this model has none")
            # The tokenizer's own EOS is the grammar's end; the engine's other stop ids follow it (below).
            eos = (self.tokenizer.eos_token_ids or self.eos_token_ids)[:1] or None
            self._lltokenizer = llguidance_module().LLTokenizer(
                self.tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=eos
            )
        return self._lltokenizer

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        key = json.dumps(dataclasses.asdict(spec), sort_keys=True)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(spec)  # outside the lock: a slow schema does not hold up the others
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > _CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        llg = llguidance_module()
        body = _body_lark(spec)
        if spec.reasoning_end:
            # Free reasoning up to its end marker, then up to two newlines, then the constraint.
            wrapper = (
                f"start: REASONING {lark_text(self.tokenizer, spec.reasoning_end)} NEWLINES @body\n"
                f"REASONING: /(?s:.*)/ & ~/(?s:.*){llg.regex_to_lark(re.escape(spec.reasoning_end))}(?s:.*)/\n"
                "NEWLINES: /\\n{0,2}/\n"  # the template's `</think>\\n\\n`; more would let a model pad forever
            )
            grammar = json.dumps(
                {"grammars": [{"lark_grammar": wrapper}, {"name": "body", "lark_grammar": body}]}
            )
        else:
            grammar = llg.LLMatcher.grammar_from_lark(body)
        error = llg.LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if error:
            raise GrammarError(f"the {_what(spec)} is invalid: {error.strip()}")
        end = self.lltokenizer.eos_token
        stop_ids = tuple(t for t in self.eos_token_ids if 0 <= t < self.vocab_size and t != end)
        return CompiledGrammar(grammar, self.lltokenizer, stop_ids)


@dataclass(slots=True, eq=False)
class GrammarMatcher:
    """One sequence's position in its grammar: the tokens it has consumed, synced on demand."""

    matcher: Any
    eos_token_id: int  # the grammar's end token
    vocab_size: int  # the mask's width in tokens
    # The engine's other ids that end a sequence (a checkpoint's EOS id can also be an ordinary token of the
    # tokenizer): the masks allow each exactly when they allow the grammar's end token (with_stop_ids).
    stop_ids: tuple[int, ...] = ()
    tokens: list[int] = field(default_factory=list)
    # The list last synced to. A request's own output list only ever grows (the engine appends to it), so
    # when it comes again its first len(tokens) entries need no comparing.
    _source: Any = None
    # The next-token bitmask at exactly `tokens` (stop ids included), once computed; None whenever it moves.
    _mask: np.ndarray | None = None

    def sync(self, tokens: Sequence[int]) -> bool:
        """Bring the matcher to exactly `tokens` (the sequence's output so far); False when the grammar
        rejects one of them (then the mask is meaningless: the row cannot be reached)."""
        have = len(self.tokens)
        if len(tokens) >= have and (tokens is self._source or tokens[:have] == self.tokens):
            common = have  # the usual case: the sequence only grew
        else:
            common = 0
            n = min(have, len(tokens))
            while common < n and self.tokens[common] == tokens[common]:
                common += 1
        if common < len(self.tokens):
            self.matcher.rollback(len(self.tokens) - common)
            del self.tokens[common:]
            self._mask = None
        self._source = tokens
        if len(tokens) == common:
            return True
        self._mask = None
        new = list(tokens[common:])
        taken = self.matcher.try_consume_tokens(new)
        self.tokens.extend(new[:taken])
        return taken == len(new)

    def mask(self) -> np.ndarray:
        """The next-token bitmask at the matcher's position (int32 words, llguidance's layout, stop ids
        allowed as the grammar's end token is), computed once per position (compute_masks_ahead computes it
        for many matchers at once)."""
        if self._mask is None:
            from llguidance.torch import fill_next_token_bitmask

            bitmask = torch.full((1, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
            fill_next_token_bitmask(self.matcher, bitmask, 0)
            words = bitmask.numpy()
            with_stop_ids(words, self.eos_token_id, self.stop_ids)
            self._mask = words[0]
        return self._mask


def with_stop_ids(words: np.ndarray, grammar_eos: int, stop_ids: Sequence[int]) -> None:
    """Bitmasks words [R, W] (int32) changed in place so that each stop id is allowed exactly when the
    grammar's end token is: an id that ends the sequence must not end the output where the grammar cannot
    end, nor be refused where it may. Done once per mask, where it is computed (the worker's batch at once),
    so the sampler reads every mask as it is."""
    if not stop_ids:
        return
    bits = words.view(np.uint32)
    end = (bits[:, grammar_eos >> 5] >> np.uint32(grammar_eos & 31)) & np.uint32(1)
    for t in stop_ids:
        bit = np.uint32(1 << (t & 31))
        bits[:, t >> 5] = (bits[:, t >> 5] & ~bit) | (end << np.uint32(t & 31))


_mask_executor: Any = None


def compute_masks_ahead(matchers: Sequence[GrammarMatcher], outputs: Sequence[Sequence[int]]) -> None:
    """Sync each matcher to its sequence and compute its next-token mask, all rows in one llguidance call
    (which drops the GIL), so the sampler finds them ready. The runner calls it on a worker thread during
    the forward; nothing else may touch these matchers until it returns. A matcher that the grammar
    rejected its sequence at gets no mask (its row is never used)."""
    global _mask_executor
    from llguidance.torch import fill_next_token_bitmask_par

    live: list[GrammarMatcher] = []
    seen: set[int] = set()
    for m, out in zip(matchers, outputs, strict=True):
        if id(m) not in seen and m.sync(out) and m._mask is None:
            seen.add(id(m))
            live.append(m)
    if not live:
        return
    if _mask_executor is None:
        # One llguidance thread: masks take microseconds each, and the forward has the cores.
        _mask_executor = llguidance_module().LLExecutor(num_threads=1)
    bitmask = torch.full((len(live), (live[0].vocab_size + 31) // 32), -1, dtype=torch.int32)
    fill_next_token_bitmask_par(_mask_executor, [(m.matcher, i) for i, m in enumerate(live)], bitmask)
    words = bitmask.numpy()
    with_stop_ids(words, live[0].eos_token_id, live[0].stop_ids)  # one grammar tokenizer, one engine: the same
    for i, m in enumerate(live):
        m._mask = words[i]


def row_masks(matchers: Sequence[GrammarMatcher], outputs: Sequence[Sequence[int]]) -> list[np.ndarray | None]:
    """Each row's mask at its sequence; None for an unreachable row (the grammar rejected a token of its
    sequence, a rejected draft before it: nothing reads the row). The verify rows of one speculating
    request share a matcher: each row's mask is taken right after syncing it (a matcher makes a new array
    when it moves, so the ones taken stay valid)."""
    return [m.mask() if m.sync(out) else None for m, out in zip(matchers, outputs, strict=True)]


def refused_rows(masks: Sequence[np.ndarray | None], tokens: Sequence[int]) -> list[int]:
    """The reachable rows whose mask refuses their token. A Python loop: numpy's per-call overhead is more
    than this work at 32 rows."""
    return [r for r, (mask, t) in enumerate(zip(masks, tokens, strict=True))
            if mask is not None and not (mask.item(t >> 5) >> (t & 31)) & 1]


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher],
                        outputs: list[Sequence[int]], greedy: list[bool]) -> None:
    """Masks (to -inf) each listed row's tokens its grammar cannot take next, in place
    (deltaserve/ops/token_mask.py). A greedy row whose argmax the grammar allows is left as it is (the
    masked row's argmax is that same token); so is an unreachable row."""
    masks = row_masks(matchers, outputs)
    checked = [r for r, mask in enumerate(masks) if greedy[r] and mask is not None]  # sampled rows take the mask
    top = logits[[rows[r] for r in checked]].argmax(dim=-1).tolist() if checked else []
    refused = {checked[i] for i in refused_rows([masks[r] for r in checked], top)}
    need = [r for r, mask in enumerate(masks) if mask is not None and (not greedy[r] or r in refused)]
    if not need:
        return
    bitmask = np.stack([masks[r] for r in need])
    idx = [rows[r] for r in need]
    if idx == list(range(logits.shape[0])):
        mask_logits_(logits, bitmask)
    else:
        logits[idx] = mask_logits_(logits[idx], bitmask)
