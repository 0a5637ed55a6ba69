"""One sequence the engine is generating: its tokens, how many of them the cache already holds, its
sampling state and text, and the timestamps metrics are built from.

A user request with n > 1 fans out into n Requests (children) that share a RequestGroup; their outputs are
gathered into one RequestOutput."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deltaserve.engine.spec_policy import AcceptanceEstimate
from deltaserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, SpecDecodeMetrics
from deltaserve.sampling import SamplingParams

if TYPE_CHECKING:
    from deltaserve.engine.sampler import SequenceSamplingState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its cache dropped; recomputed from prompt + output later
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str  # unique inside the engine (a child of an n>1 request gets its own)
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: SequenceSamplingState
    detokenizer: Any | None  # IncrementalDetokenizer, None when the model has no tokenizer
    group: RequestGroup
    index: int = 0  # which of the group's n outputs this is
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens (prompt then output) whose K/V and GDN state the cache holds; the rest are still to compute.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens a prefix cache hit supplied when first scheduled
    cache_salt: str | None = None  # keeps this prompt's cached prefix apart from other salts' (vLLM's)
    # (first token, end, content hash) of each image's placeholder tokens: prefix hashing keys on them
    image_spans: list[tuple[int, int, str]] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))
    # Speculation: drafts proposed after the last step, to verify in the next one (not yet part of the
    # output), the distribution each was drawn from (None rows for greedy), and the running counters.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: list[Any] = field(default_factory=list)  # per draft: probs [V] or None
    spec_metrics: SpecDecodeMetrics | None = None
    spec_acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # adaptive k's estimate
    # Adaptive k: L, the last L computed positions whose MTP entries are still to run (spec_decode.
    # SpecDecoder.propose), 0 when the MTP cache is up to date; and their trunk hidden rows, as (a step's
    # hidden, first row, rows) pieces in position order.
    spec_backlog: int = 0
    spec_held: list[tuple[Any, int, int]] = field(default_factory=list)
    # Adaptive k, where drafting does not pay: the request dropped its MTP upkeep (runs no MTP entries and
    # drafts no more) until a preemption recomputes it.
    spec_lapsed: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model before this request can sample again."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole history."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass(slots=True, eq=False)
class RequestGroup:
    """The user's request: n sequences generated from one prompt, reported together."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    children: list[Request] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)

    def output(self) -> RequestOutput:
        first = min(
            (c.metrics.first_token_time for c in self.children if c.metrics.first_token_time), default=None
        )
        # The group's metrics: the first child's record, with the earliest first token of any child.
        m = self.children[0].metrics
        metrics = RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=m.first_scheduled_time,
            first_token_time=first,
            last_token_time=max(
                (c.metrics.last_token_time for c in self.children if c.metrics.last_token_time), default=None
            ),
            finished_time=max((c.metrics.finished_time or 0.0 for c in self.children), default=None)
            if self.finished
            else None,
            num_preemptions=sum(c.metrics.num_preemptions for c in self.children),
            inter_token_latencies=list(m.inter_token_latencies),
            num_generation_tokens=max(c.metrics.num_generation_tokens for c in self.children),
        )
        spec = None
        for c in self.children:
            if c.spec_metrics is not None:
                spec = spec or SpecDecodeMetrics()
                spec.add(c.spec_metrics)
        return RequestOutput(
            spec=spec,
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.completion() for c in self.children],
            finished=self.finished,
            metrics=metrics,
            num_cached_tokens=self.children[0].num_cached_tokens,
        )
