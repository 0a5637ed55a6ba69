"""Sampling parameters of one request, with vLLM's field names, defaults and validation ranges, so that a
user who knows vLLM's `SamplingParams` can use these unchanged."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

# vLLM treats temperatures below this as greedy: dividing by ~0 would overflow the logits.
_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrained decoding, as vLLM's StructuredOutputsParams: exactly one of json (a JSON schema, dict or
    string), regex, choice (the output is one of these strings), grammar (Lark, or GBNF with `::=`) or
    json_object (any JSON object). The grammar engine (llguidance, deltaserve/engine/structured.py) masks
    every token the constraint cannot continue with.

    reasoning_end: the constraint starts after this text (the chat server passes "</think>" when the
    prompt leaves a think block open, so the reasoning stays free, as vLLM's reasoning parser does)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar or json_object, "
                f"got {given or 'none'}"
            )
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token (the chosen token is always added)
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.logit_bias is not None:
            # JSON objects (the OpenAI API) can only have string keys: accept "123" as token 123.
            self.logit_bias = {
                (int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k): v
                for k, v in dict(self.logit_bias).items()
            }
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )
        self._validate()

    def _validate(self) -> None:
        def fail(field: str, expected: str, value: object) -> None:
            raise ValueError(f"{field} must be {expected}, got {value!r}")

        if not _is_int(self.n) or self.n < 1:
            fail("n", ">= 1", self.n)
        if not _is_number(self.temperature) or self.temperature < 0:
            fail("temperature", ">= 0", self.temperature)
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or (self.top_k < -1):
            fail("top_k", "-1 or 0 (disabled) or >= 1", self.top_k)
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]", self.min_p)
        if not _is_number(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not _is_number(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            fail("repetition_penalty", "> 0", self.repetition_penalty)
        if self.seed is not None and not _is_int(self.seed):
            fail("seed", "an integer or None", self.seed)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            fail("max_tokens", ">= 1", self.max_tokens)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", ">= 0", self.min_tokens)
        if self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            fail("logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None", self.logprobs)
        assert isinstance(self.stop, list)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                fail("stop", "a non-empty string or a list of non-empty strings", s)
        assert isinstance(self.stop_token_ids, list)
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                fail("stop_token_ids", "a list of non-negative token ids", t)
        if self.logit_bias is not None:
            for k, v in self.logit_bias.items():
                if not _is_int(k) or k < 0:
                    fail("logit_bias", "keyed by non-negative integer token ids", k)
                # vLLM's range: an infinite bias would turn the softmax into NaN.
                if not _is_number(v) or not -100 <= v <= 100:
                    fail("logit_bias", "a mapping of token id to a number in [-100, 100]", v)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x  # x == x rejects NaN
