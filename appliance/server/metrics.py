"""Prometheus metrics under vLLM's names with the `appliance:` prefix, in a per-app registry.

Counters and histograms are fed by a StatsSink the engine calls in its own thread
(prometheus_client is thread-safe) and by the server's streaming side (inter-token latency).
Gauges (queue sizes, KV usage, knobs) are read from the engine's snapshot at scrape time, so
the hot path does no gauge work at all.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.stats import FinishReason, HoldCause, IterationStats, RequestStats, StatsSink

PREFIX = "appliance:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _LiveCollector(Collector):
    """Gauges read at scrape time from a snapshot function."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield GaugeMetricFamily(PREFIX + "num_requests_running", "Requests in the running batch.",
                                value=snap["running"])
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.",
                                value=snap["waiting"])
        total = snap["kv_blocks_total"] or 1
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "KV cache usage (1 means 100 percent).",
                                value=snap["kv_blocks_used"] / total)
        yield GaugeMetricFamily(PREFIX + "knob_version", "Version of the knob set in force.",
                                value=snap["knob_version"])
        for name, value in snap["knobs"].items():
            if isinstance(value, str):
                family = GaugeMetricFamily(PREFIX + f"knob_{name}", f"Knob {name} (1 for the value in force).",
                                           labels=[name])
                family.add_metric([value], 1)
            else:
                family = GaugeMetricFamily(PREFIX + f"knob_{name}", f"Knob {name}.", value=value)
            yield family
        yield CounterMetricFamily(PREFIX + "telemetry_rows_dropped", "Telemetry records lost.",
                                  value=snap["telemetry_rows_dropped"])


class ServerMetrics(StatsSink):
    """The server's Prometheus registry; add it to the engine as a sink."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.preemptions = Counter(PREFIX + "num_preemptions", "Cumulative preemptions.", registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.prefix_cache_queries = Counter(PREFIX + "prefix_cache_queries",
                                            "Prompt tokens of finished requests looked up in the prefix cache.",
                                            registry=r)
        self.prefix_cache_hits = Counter(PREFIX + "prefix_cache_hits",
                                         "Prompt tokens of finished requests served from the prefix cache.",
                                         registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens",
                                         "Generated tokens of finished requests.", registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                       ["finished_reason"], registry=r)
        for reason in FinishReason:
            self.request_success.labels(reason)
        self.held_requests = Counter(PREFIX + "num_requests_held",
                                     "Waiting requests not admitted, summed over iterations, by the limit "
                                     "that held them.", ["cause"], registry=r)
        for cause in HoldCause:
            self.held_requests.labels(cause)
        self.chunk_deferred_tokens = Counter(PREFIX + "prefill_tokens_deferred_by_chunk",
                                             "Prefill tokens within the budget left for later iterations by "
                                             "long_prefill_token_threshold.", registry=r)
        self.iteration_tokens = Histogram(PREFIX + "iteration_tokens_total", "Tokens scheduled per iteration.",
                                          buckets=_ITERATION_TOKEN_BUCKETS, registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first scheduling.",
                                    buckets=_E2E_BUCKETS, registry=r)
        r.register(_LiveCollector(snapshot))

    # -- engine thread --------------------------------------------------------------------------
    def on_iteration(self, stats: IterationStats) -> None:
        if stats.preemptions:
            self.preemptions.inc(stats.preemptions)
        self.iteration_tokens.observe(stats.scheduled_tokens)
        for cause in HoldCause:
            held = getattr(stats, cause.column)
            if held:
                self.held_requests.labels(cause).inc(held)
        if stats.chunk_deferred_tokens:
            self.chunk_deferred_tokens.inc(stats.chunk_deferred_tokens)

    def on_request(self, stats: RequestStats) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.prefix_cache_queries.inc(stats.prompt_tokens)
        self.prefix_cache_hits.inc(stats.cached_tokens)
        self.generation_tokens.inc(stats.output_tokens)
        self.request_success.labels(stats.finish_reason).inc()
        self.e2e.observe(max(0.0, stats.finished - stats.arrival))
        if stats.first_token is not None:
            self.ttft.observe(max(0.0, stats.first_token - stats.arrival))
        if stats.first_scheduled is not None:
            self.queue_time.observe(max(0.0, stats.first_scheduled - stats.arrival))

    # -- event loop ------------------------------------------------------------------------------
    def observe_itl(self, seconds: float, tokens: int = 1) -> None:
        for _ in range(tokens):
            self.itl.observe(seconds / tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
