"""Prometheus metrics, named after vLLM's (`vllm:` -> `deltaserve:`), in a registry of their own so that
two apps in one process (tests) do not collide. Gauges are refreshed on the engine thread after every
loop iteration; per-request histograms are observed when a request finishes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from deltaserve.engine.async_engine import AsyncEngine
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets, seconds: CPU decode sits in the tens of milliseconds, prefill up to seconds.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"deltaserve:{name}", doc, labels, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.kv_used = gauge("kv_cache_used_blocks", "KV cache blocks in use.")
        self.kv_total = gauge("kv_cache_total_blocks", "KV cache blocks in the pool.")
        self.slot_usage = gauge("gdn_state_usage_perc", "Fraction of GDN recurrent-state slots in use (0-1).")
        self.slot_used = gauge("gdn_state_used_slots", "GDN recurrent-state slots in use.")
        self.slot_total = gauge("gdn_state_total_slots", "GDN recurrent-state slots in the pool.")
        self.preemptions = gauge("num_preemptions", "Preemptions since start (cumulative).")
        # Prefix caching (vLLM's counters, in tokens) and the GDN snapshot pool it keeps.
        self.prefix_queries = Counter(
            "deltaserve:prefix_cache_queries", "Prefix cache queries, in tokens looked up at admission.",
            labels, registry=r,
        ).labels(model_name)
        self.prefix_hits = Counter(
            "deltaserve:prefix_cache_hits", "Prefix cache hits, in cached tokens reused.", labels, registry=r
        ).labels(model_name)
        self.snapshot_bytes = gauge("gdn_snapshot_memory_bytes", "Memory of the GDN state snapshots held for "
                                    "prefix caching (bytes).")
        self.snapshot_used = gauge("gdn_snapshot_used", "GDN state snapshots held for prefix caching.")
        self._prefix_seen = (0, 0)
        self.prompt_tokens = Counter(
            "deltaserve:prompt_tokens", "Prompt tokens of requests that started.", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "deltaserve:generation_tokens", "Tokens generated.", labels, registry=r
        ).labels(model_name)
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"deltaserve:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Gap between consecutive steps that emit a request's output tokens.", _ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Decode time per output token after the first, per request.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", _E2E_BUCKETS)
        self._success = Counter(
            "deltaserve:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        # Speculative decoding (vLLM's names); exported only while an engine speculates.
        self._spec = {
            name: Counter(f"deltaserve:spec_decode_{name}", doc, labels, registry=r).labels(model_name)
            for name, doc in (
                ("num_drafts", "Verify steps of speculating sequences."),
                ("num_draft_tokens", "Draft tokens proposed by the MTP head."),
                ("num_accepted_tokens", "Draft tokens accepted."),
            )
        }
        self._spec_per_pos = Counter(
            "deltaserve:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft.", ["model_name", "position"], registry=r,
        )
        self._spec_seen: dict[str, int] = {}
        self._model_name = model_name
        self._generation_seen = 0
        self._started: set[str] = set()

    def attach(self, engine: AsyncEngine) -> None:
        engine.iteration_listeners.append(self.on_iteration)
        engine.output_listeners.append(self.on_output)
        engine.refresh()  # cache sizes show from the start, not from the first request

    # Both run on the engine thread.
    def on_iteration(self, engine: LLMEngine) -> None:
        s = engine.stats()
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        c = s.cache
        self.kv_used.set(c.used_blocks)
        self.kv_total.set(c.total_blocks)
        self.kv_usage.set(c.used_blocks / c.total_blocks if c.total_blocks else 0.0)
        self.slot_used.set(c.used_slots)
        self.slot_total.set(c.total_slots)
        self.slot_usage.set(c.used_slots / c.total_slots if c.total_slots else 0.0)
        self.preemptions.set(s.num_preemptions)
        if s.generation_tokens > self._generation_seen:
            self.generation_tokens.inc(s.generation_tokens - self._generation_seen)
            self._generation_seen = s.generation_tokens
        if s.prefix_cache is not None:
            queries, hits = s.prefix_cache.queries, s.prefix_cache.hits
            self.prefix_queries.inc(queries - self._prefix_seen[0])
            self.prefix_hits.inc(hits - self._prefix_seen[1])
            self._prefix_seen = (queries, hits)
            self.snapshot_bytes.set(c.snapshot_bytes)
            self.snapshot_used.set(c.used_snapshots)
        if s.spec is not None:
            values = {name: getattr(s.spec, name) for name in self._spec}
            values |= {f"pos{i}": n for i, n in enumerate(s.spec.accepted_per_position)}
            for key, value in values.items():
                delta = value - self._spec_seen.get(key, 0)
                if delta > 0:
                    if key in self._spec:
                        self._spec[key].inc(delta)
                    else:
                        self._spec_per_pos.labels(self._model_name, key[3:]).inc(delta)
                    self._spec_seen[key] = value

    def on_output(self, out: RequestOutput) -> None:
        rid = out.request_id
        if rid not in self._started and any(c.token_ids for c in out.outputs):
            self._started.add(rid)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            m = out.metrics
            if m is not None and m.time_to_first_token is not None:
                self.ttft.observe(m.time_to_first_token)
        if not out.finished:
            return
        self._started.discard(rid)
        for c in out.outputs:
            self._success.labels(self._model_name, c.finish_reason or "abort").inc()
        m = out.metrics
        if m is not None:
            for gap in m.inter_token_latencies:
                self.itl.observe(gap)
            if m.time_per_output_token is not None:
                self.tpot.observe(m.time_per_output_token)
            if m.e2e_latency is not None:
                self.e2e.observe(m.e2e_latency)

    def render(self) -> bytes:
        return generate_latest(self.registry)
