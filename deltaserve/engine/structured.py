"""Structured outputs through llguidance: a request's StructuredOutputsParams compiles to one grammar, each
sequence gets a matcher over it, and the sampler masks every token the matcher cannot take.

llguidance was picked by measuring, on the demo's 8192-token vocabulary with one thread, the cost of a
step's masks for a JSON schema (compute + consume; the mask itself is applied by torch either way):
llguidance 25 us at batch 1 and 424 us at batch 32, xgrammar 0.2.8 4 us and 178 us, outlines-core 0.2.14
27 ms (its guide is built per regex, not per token trie). A demo decode step at batch 32 takes tens of
milliseconds, so both Rust engines cost about 1% of it; llguidance installs alone (xgrammar pulls in
transformers and triton at run time), takes Lark and GBNF grammars (vLLM's `grammar`), and rolls back,
which speculative decoding needs.

Matchers follow the sequence lazily: before each mask the matcher is synced to the tokens the sampler is
asked about (rolling back what differs, then consuming the new ones). So the engine needs no hook when a
token is accepted, and speculative decoding works unchanged: the verify rows of one request sync the
matcher one draft further each, and the next step rolls back the rejected drafts. A draft the grammar
rejects leaves the rows after it unmasked; they are never used, because the row before masks that draft
(greedy argmax cannot pick it, rejection sampling accepts it with probability 0)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deltaserve.sampling import StructuredOutputsParams

# JSON without free whitespace: with flexible whitespace a model can pad forever, and OpenAI's own
# structured outputs look like json.dumps (", " and ": ").
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BITS = 1 << torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """A schema, regex or grammar llguidance cannot compile; the message says which and why."""


def _llguidance() -> Any:
    import llguidance  # imported on first use: plain requests never pay for it

    return llguidance


def lark_text(tokenizer: Any, text: str) -> str:
    """`text` as a Lark terminal: an added token (`</think>`, `<tool_call>` in Qwen vocabularies) is one
    token that llguidance names `<[id]>`; anything else is a quoted literal."""
    tid = tokenizer.token_to_id(text) if tokenizer is not None else None
    if tid is not None and tid in _added_ids(tokenizer):
        return f"<[{tid}]>"
    return json.dumps(text)


def _added_ids(tokenizer: Any) -> set[int]:
    cached = getattr(tokenizer, "_added_ids_for_grammar", None)
    if cached is None:
        cached = set(tokenizer._tok.get_added_tokens_decoder())
        tokenizer._added_ids_for_grammar = cached
    return cached


def json_schema_lark(schema: dict[str, Any] | bool) -> str:
    """A Lark expression for one JSON value of `schema` (the compact whitespace above)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    merged = dict(schema)
    merged["x-guidance"] = {**_JSON_OPTIONS, **schema.get("x-guidance", {})}
    return "%json " + json.dumps(merged)


def _body_lark(spec: StructuredOutputsParams) -> str:
    """The constraint's own Lark grammar (a `start` rule)."""
    llg = _llguidance()
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
    """One request's grammar, checked against the tokenizer; matcher() gives each sequence its own."""

    grammar: str
    lltokenizer: Any

    def matcher(self) -> GrammarMatcher:
        eos = self.lltokenizer.eos_token
        return GrammarMatcher(_llguidance().LLMatcher(self.lltokenizer, self.grammar, log_level=0), eos)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer (its llguidance token trie is built once)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lltokenizer: Any = None

    @property
    def lltokenizer(self) -> Any:
        if self._lltokenizer is None:
            if self.tokenizer is None:
                raise GrammarError("structured outputs need the model's tokenizer, and this model has none")
            # The tokenizer's own EOS is the grammar's end; the engine's other stop ids follow it (below).
            eos = (self.tokenizer.eos_token_ids or self.eos_token_ids)[:1] or None
            self._lltokenizer = _llguidance().LLTokenizer(
                self.tokenizer._tok.to_str(), n_vocab=self.vocab_size, eos_token=eos
            )
        return self._lltokenizer

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        llg = _llguidance()
        body = _body_lark(spec)
        if spec.reasoning_end:
            # Free reasoning up to its end marker, then newlines, then the constraint.
            wrapper = (
                f"start: REASONING {lark_text(self.tokenizer, spec.reasoning_end)} NEWLINES @body\n"
                f"REASONING: /(?s:.*)/ & ~/(?s:.*){llg.regex_to_lark(_re_escape(spec.reasoning_end))}(?s:.*)/\n"
                "NEWLINES: /\\n*/\n"
            )
            grammar = json.dumps(
                {"grammars": [{"lark_grammar": wrapper}, {"name": "body", "lark_grammar": body}]}
            )
        else:
            grammar = llg.LLMatcher.grammar_from_lark(body)
        error = llg.LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if error:
            raise GrammarError(f"the {_what(spec)} is invalid: {error.strip()}")
        return CompiledGrammar(grammar, self.lltokenizer)


def _re_escape(text: str) -> str:
    import re

    return re.escape(text)


@dataclass(slots=True, eq=False)
class GrammarMatcher:
    """One sequence's position in its grammar: the tokens it has consumed, synced on demand."""

    matcher: Any
    eos_token_id: int  # the grammar's end token
    tokens: list[int] = field(default_factory=list)

    def sync(self, tokens: Sequence[int]) -> bool:
        """Bring the matcher to exactly `tokens` (the sequence's output so far); False when the grammar
        rejects one of them (then the mask is meaningless: the row cannot be reached)."""
        common = 0
        n = min(len(self.tokens), len(tokens))
        while common < n and self.tokens[common] == tokens[common]:
            common += 1
        if common < len(self.tokens):
            self.matcher.rollback(len(self.tokens) - common)
            del self.tokens[common:]
        new = list(tokens[common:])
        if new:
            taken = self.matcher.try_consume_tokens(new)
            self.tokens.extend(new[:taken])
            return taken == len(new)
        return True

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, bitmask, row)


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher],
                        outputs: list[Sequence[int]], eos_token_ids: Sequence[int]) -> None:
    """Masks (to -inf) each listed row's tokens its grammar cannot take next, in place."""
    vocab = logits.shape[1]
    bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
    masked: list[int] = []
    for r, (m, out) in enumerate(zip(matchers, outputs, strict=True)):
        if not m.sync(out):
            continue  # an unreachable row (a rejected draft before it): leave it as it is
        m.fill_mask(bitmask, r)
        masked.append(r)
    if not masked:
        return
    allowed = (bitmask[masked].unsqueeze(-1) & _BITS).ne(0).view(len(masked), -1)[:, :vocab]
    # Every id that ends the sequence is allowed exactly when the grammar may end (a checkpoint's EOS id
    # can also be an ordinary token of the tokenizer: it must not end the output early).
    stop = allowed[:, matchers[masked[0]].eos_token_id].clone()
    eos = [t for t in eos_token_ids if 0 <= t < vocab]
    if eos:
        allowed[:, eos] = stop.unsqueeze(1).expand(-1, len(eos))
    idx = [rows[r] for r in masked]
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
