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

    def append_run(self, req: Request, tokens: list[int], logprobs: list[dict[int, float] | None], now: float
                   ) -> RequestStatus | None:
        """Append the tokens one step emitted for req (one, or a verify's accepted drafts and its own) until
        one finishes it; the status it finishes with, or None while it goes on.

        A step's tokens arrive together, so they are timed as vLLM times them: each step that emits tokens
        after the first one records one inter-token latency, the time since the request's previous tokens
        (a verify step's accepted drafts add no zero gaps), and the time per output token is the decode
        time over the tokens after the first (RequestMetrics.time_per_output_token)."""
        m = req.metrics
        previous = m.last_token_time
        status = None
        for token, lp in zip(tokens, logprobs, strict=True):
            m.num_generation_tokens += 1
            status = self._append(req, token, lp, now)
            if status is not None:
                break
        if m.first_token_time is None:
            m.first_token_time = now  # its wait is the time to first token, not a gap
        elif previous is not None:
            m.inter_token_latencies.append(now - previous)
        m.last_token_time = now
        if status is not None:
            m.finished_time = now
        return status

    def _append(self, req: Request, token: int, logprobs: dict[int, float] | None, now: float
                ) -> RequestStatus | None:
        self.generation_tokens += 1
        req.output_token_ids.append(token)
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
        return RequestStatus.FINISHED_STOPPED if reason == "stop" else RequestStatus.FINISHED_LENGTH
