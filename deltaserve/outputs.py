"""What the engine hands back per request: vLLM's RequestOutput / CompletionOutput, field for field."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic seconds) from which TTFT, ITL and end-to-end latency are derived."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Inter-token latencies, seconds, as vLLM counts them: one per step that emitted tokens after the first
    # token, the time since the previous step that emitted some (a verify step's tokens arrive together).
    inter_token_latencies: list[float] = field(default_factory=list)
    num_generation_tokens: int = 0  # output tokens so far (a group of n > 1: its longest child's)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Decode seconds per output token after the first (vLLM's request_time_per_output_token)."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class SpecDecodeMetrics:
    """Speculative decoding counters (vLLM's names): a draft is one verify step of one sequence."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: drafts whose (i+1)-th token was accepted (length num_speculative_tokens)
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step: the accepted drafts plus the one the target always adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def add(self, other: SpecDecodeMetrics) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        missing = len(other.accepted_per_position) - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(missing, 0)
        for i, n in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += n

    def record(self, num_drafted: int, num_accepted: int, k: int) -> None:
        if len(self.accepted_per_position) < k:
            self.accepted_per_position += [0] * (k - len(self.accepted_per_position))
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (one of the n of a request)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    spec: SpecDecodeMetrics | None = None  # speculative decoding counters, summed over the n sequences
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's name)
