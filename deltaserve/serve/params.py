"""Request fields -> SamplingParams: the operator's rules (the cap on n, the model's generation_config.json
defaults), the context-length checks, and vLLM's default max_tokens (what is left of the context after the
prompt)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltaserve.sampling import SamplingParams
from deltaserve.serve.errors import APIError, param_of
from deltaserve.serve.protocol import ChatCompletionRequest, CompletionRequest

_FIELDS = tuple(SamplingParams.__dataclass_fields__) + ("top_logprobs", "max_completion_tokens", "messages")
# The sampling fields a generation_config.json may default (vLLM's list; max_new_tokens -> max_tokens).
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


@dataclass(slots=True)
class RequestRules:
    """What the server enforces or fills in on every request."""

    max_n: int = 128  # --max-n: more sequences per prompt is a 400
    defaults: dict[str, Any] = field(default_factory=dict)  # generation_config.json (--generation-config)
    max_token_chars: int | None = None  # the longest vocabulary entry: bounds a prompt's length untokenized

    def check(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        """Fields refused before any work: n past the cap, OpenAI fields deltaserve cannot honour."""
        if req.n > self.max_n:
            raise APIError(400, f"n must be <= {self.max_n} on this server (--max-n), got {req.n}", param="n")
        best_of = getattr(req, "best_of", None)
        if best_of is not None and best_of != req.n:
            raise APIError(
                400, f"best_of is not supported (only best_of == n, got best_of={best_of}, n={req.n})",
                param="best_of",
            )
        if getattr(req, "suffix", None) is not None:
            raise APIError(400, "suffix is not supported (this model has no fill-in-the-middle mode)",
                           param="suffix")

    def check_text_length(self, text: str, max_model_len: int, what: str) -> None:
        """Refuse, before tokenizing, a prompt text too long for the context whatever its tokens are: each
        token covers at most max_token_chars characters (halved, for normalizers that merge characters)."""
        if self.max_token_chars is None:
            return
        at_least = len(text) // (2 * self.max_token_chars)
        if at_least >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                f"at least {at_least} input tokens ({len(text)} characters). Please reduce the length of the "
                f"input {what}.",
                param=what,
            )


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int, what: str = "messages") -> int:
    """The max_tokens to use; raises 400 with both lengths, worded as vLLM's, when it cannot fit."""
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input {what}.",
            param=what,
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} in the "
            f"completion). Please reduce the length of the {what} or completion.",
            param="max_tokens",
        )
    return max_tokens


def requested_max_tokens(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return req.max_tokens


def scores_only(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """max_tokens 0 with echo: the legacy way to score a prompt (its logprobs), generating nothing."""
    return isinstance(req, CompletionRequest) and req.echo and req.max_tokens == 0


def to_sampling_params(
    req: ChatCompletionRequest | CompletionRequest, prompt_len: int, max_model_len: int,
    rules: RequestRules | None = None,
) -> SamplingParams:
    defaults = rules.defaults if rules is not None else {}
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    max_tokens = requested_max_tokens(req)
    if max_tokens is not None and max_tokens < 1:
        hint = "" if isinstance(req, ChatCompletionRequest) else " (0 is allowed with echo, to score the prompt)"
        raise APIError(400, f"max_tokens must be >= 1{hint}, got {max_tokens}", param="max_tokens")
    what = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    max_tokens = check_context(prompt_len, max_tokens, max_model_len, what)
    if requested_max_tokens(req) is None and "max_tokens" in defaults:
        max_tokens = min(max_tokens, defaults["max_tokens"])
    optional = dict(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
    )
    # What the request leaves out, the model's generation_config.json fills in (vLLM's order).
    for name, value in defaults.items():
        if name in optional and optional[name] is None:
            optional[name] = value
    try:
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            logit_bias=req.logit_bias,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            **{k: v for k, v in optional.items() if v is not None},
        )
    except (ValueError, TypeError) as e:
        message = str(e)
        if message.startswith("logprobs") and isinstance(req, ChatCompletionRequest):
            message = "top_logprobs" + message[len("logprobs") :]
        raise APIError(400, message, param=param_of(message, _FIELDS)) from e
