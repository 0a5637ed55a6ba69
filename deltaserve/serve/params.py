"""Request fields -> SamplingParams, with the context-length checks and vLLM's default max_tokens (what
is left of the context after the prompt)."""

from __future__ import annotations

from deltaserve.sampling import SamplingParams
from deltaserve.serve.errors import APIError, param_of
from deltaserve.serve.protocol import ChatCompletionRequest, CompletionRequest

_FIELDS = tuple(SamplingParams.__dataclass_fields__) + ("top_logprobs", "max_completion_tokens", "messages")


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


def to_sampling_params(
    req: ChatCompletionRequest | CompletionRequest, prompt_len: int, max_model_len: int
) -> SamplingParams:
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens = req.max_tokens
        logprobs = req.logprobs
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    what = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    max_tokens = check_context(prompt_len, max_tokens, max_model_len, what)
    optional = dict(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
    )
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
