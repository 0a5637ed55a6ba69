"""Applies one new token to a request: its output ids, logprobs, timestamps and text, then the stop checks.
The scheduler calls it while it applies a step's results (Scheduler.update_from_output)."""

from __future__ import annotations

from deltaserve.engine.detokenizer import check_stop
from deltaserve.engine.request import Request, RequestStatus


class OutputProcessor:
    def __init__(self, eos_token_ids: list[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.generation_tokens = 0  # tokens appended, all steps

    def append(self, req: Request, token: int, logprobs: dict[int, float] | None, now: float
               ) -> RequestStatus | None:
        """Append token to req; the status req finishes with after it, or None while it goes on."""
        self.generation_tokens += 1
        req.output_token_ids.append(token)
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        elif m.last_token_time is not None:
            m.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        if req.logprobs is not None and logprobs is not None:
            req.logprobs.append(logprobs)
            req.cumulative_logprob = (req.cumulative_logprob or 0.0) + logprobs.get(token, 0.0)
        delta_len = 0
        if req.detokenizer is not None:
            delta_len = len(req.detokenizer.add(token))
            text = req.detokenizer.text
        else:
            text = ""
        result = check_stop(text, delta_len, token, len(req.output_token_ids), req.params, self.eos_token_ids)
        reason = result.finish_reason
        req.text = result.text
        if reason is None and req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            return None
        if reason == "length" and req.detokenizer is not None:
            req.detokenizer.flush()  # bytes held back for an unfinished character come out now
            req.text = req.detokenizer.text
        req.stop_reason = result.stop_reason
        m.finished_time = now
        return RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH
