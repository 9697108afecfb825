"""Benchmark maths: per-request latencies, percentiles, run summaries, SLOs and goodput.

Pure functions over plain records, in seconds throughout. Definitions (as vLLM's benchmark):
  TTFT  time from sending the request to the first streamed chunk carrying output
  E2E   time from sending the request to the end of the stream
  TPOT  (E2E - TTFT) / (output_tokens - 1), for requests with more than one output token
  ITL   the gaps between consecutive output chunks of one request (pooled over all requests)
An SLO's `itl` target holds for a request when none of its gaps exceeds it (no stall longer
than that while it streams): the per-request form of an ITL tail target.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from appliance.numeric import percentile

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True)
class Distribution:
    """Mean, median, tail percentiles and extremes of one metric (None fields when no data)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    min: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> "Distribution":
        if not values:
            return cls(0, None, None, None, None, None, None)
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(len(values), sum(values) / len(values), p50, p90, p99, min(values), max(values))


@dataclass
class RequestResult:
    """What the client saw of one request it sent (times in seconds, from `sent_at`).

    `error_kind`: None when ok, else one of "http_<4xx code>" (e.g. "http_429"), "http_5xx",
    "timeout", "connection", "aborted" (the server ended the stream early or reported an error
    in it), "protocol" (unparseable stream) or "cancelled" (stopped by the client: the run was
    cancelled or hit its duration limit).
    """

    index: int  # position in the workload
    sent_at: float  # wall clock (time.time()) when the request was sent
    ok: bool = False
    error_kind: str | None = None
    error: str | None = None
    status: int | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int | None = None  # as reported by the server's usage
    cached_tokens: int | None = None  # of those, served from the prefix cache (usage.prompt_tokens_details)
    output_tokens: int | None = None  # usage, else the number of output chunks
    requested_output_len: int | None = None
    finish_reason: str | None = None
    server_request_id: str | None = None
    replica: str | None = None  # the appliance replica that served it (its X-Appliance-Replica header)
    text: str = ""  # the reply's text as received

    @property
    def tpot(self) -> float | None:
        return tpot(self.e2e, self.ttft, self.output_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot": self.tpot}


def tpot(e2e: float | None, ttft: float | None, output_tokens: int | None) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
    if e2e is None or ttft is None or output_tokens is None or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def itl_from_times(chunk_times: Sequence[float]) -> list[float]:
    """Inter-token latencies: gaps between consecutive chunk arrival times."""
    return [b - a for a, b in zip(chunk_times, chunk_times[1:])]


# -------------------------------------------------------------------------------------------- SLO

_SLO_PART = re.compile(r"^\s*([a-z0-9_]+)\s*[=:]\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds; a request meets the SLO when every given target holds."""

    ttft: float | None = None
    tpot: float | None = None
    itl: float | None = None  # the longest gap between two of the request's output chunks
    e2e: float | None = None

    def met_by(self, r: RequestResult) -> bool:
        """Ok and within every target. A target whose metric is undefined for the request
        (TPOT or ITL of a one-token reply, TTFT of an empty one) holds."""
        if not r.ok:
            return False
        checks = ((self.ttft, r.ttft), (self.tpot, r.tpot), (self.itl, max(r.itl, default=None)), (self.e2e, r.e2e))
        return all(target is None or value is None or value <= target for target, value in checks)

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def __str__(self) -> str:
        return ",".join(f"{k}={v * 1000:g}ms" for k, v in self.as_dict().items())


def parse_slo(text: str) -> SLO:
    """Parse "ttft=500ms,tpot=100ms,itl=300ms,e2e=2s" (any subset; ':' also separates; units ms or s)."""
    if not text or not text.strip():
        raise ValueError("empty SLO: expected e.g. ttft=500ms,tpot=100ms,e2e=2s")
    values: dict[str, float] = {}
    for part in text.split(","):
        match = _SLO_PART.match(part.lower())
        if not match:
            raise ValueError(
                f"bad SLO part {part.strip()!r}: expected NAME=VALUE with NAME one of "
                f"{', '.join(SLO_METRICS)} and VALUE like 500ms or 2s"
            )
        name, number, unit = match.groups()
        if name not in SLO_METRICS:
            raise ValueError(
                f"bad SLO part {part.strip()!r}: unknown metric {name!r}; "
                f"expected one of {', '.join(SLO_METRICS)}"
            )
        if unit is None:
            raise ValueError(f"bad SLO part {part.strip()!r}: add a unit, e.g. {number}ms or {number}s")
        if name in values:
            raise ValueError(f"bad SLO part {part.strip()!r}: {name} is given twice")
        seconds = float(number) / (1000 if unit == "ms" else 1)
        if seconds <= 0:
            raise ValueError(f"bad SLO part {part.strip()!r}: the target must be above zero")
        values[name] = seconds
    return SLO(**values)


# ---------------------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class Summary:
    """A run's headline figures. Latency distributions cover successful requests only."""

    num_requests: int  # in the workload
    sent: int
    completed: int  # ok
    failed: int  # sent but not ok (cancelled included)
    not_sent: int  # never sent because the run stopped first
    errors: dict[str, int]  # failed requests by error kind
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int  # input tokens the server served from its prefix cache
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens of completed requests per second
    total_token_throughput: float  # input + output tokens of completed requests per second
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    output_len_mismatch: int  # completed requests whose output length differs from the forced one
    slo: SLO | None
    slo_met: int | None  # completed requests within the SLO
    goodput: float | None  # requests per second within the SLO
    replicas: dict[str, int]  # completed requests by the replica that served them (load balance)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Share of the completed requests' input tokens served from the server's prefix cache."""
        return self.total_cached_tokens / self.total_input_tokens if self.total_input_tokens else None

    @property
    def balance(self) -> str:
        """The fleet size and its load balance, e.g. '2 replicas: a 16, b 15' ('' when unnamed)."""
        if not self.replicas:
            return ""
        return balance_text(self.replicas)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["slo"] = self.slo.as_dict() if self.slo else None
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        return d


def balance_text(replicas: dict[str, int]) -> str:
    """'2 replicas: a 16, b 15' from completed requests by replica."""
    n = len(replicas)
    return f"{n} replica{'s' if n != 1 else ''}: " + ", ".join(f"{r} {c}" for r, c in replicas.items())


def error_counts(results: Iterable[RequestResult]) -> dict[str, int]:
    """Failed requests counted by error kind, sorted by kind."""
    counts: dict[str, int] = {}
    for r in results:
        if not r.ok:
            kind = r.error_kind or "unknown"
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    num_requests: int | None = None,
    slo: SLO | None = None,
) -> Summary:
    """Summarise one run. Throughputs divide by `duration_s` (the run's wall time)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be above zero, got {duration_s}")
    num_requests = len(results) if num_requests is None else num_requests
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    slo_met = sum(slo.met_by(r) for r in ok) if slo else None
    return Summary(
        num_requests=num_requests,
        sent=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        not_sent=num_requests - len(results),
        errors=error_counts(results),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        total_cached_tokens=sum(r.cached_tokens or 0 for r in ok),
        request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        ttft=Distribution.of([r.ttft for r in ok if r.ttft is not None]),
        tpot=Distribution.of([t for t in (r.tpot for r in ok) if t is not None]),
        itl=Distribution.of([gap for r in ok for gap in r.itl]),
        e2e=Distribution.of([r.e2e for r in ok if r.e2e is not None]),
        output_len_mismatch=sum(
            1 for r in ok
            if r.requested_output_len is not None and r.output_tokens != r.requested_output_len
        ),
        slo=slo,
        slo_met=slo_met,
        goodput=None if slo is None else slo_met / duration_s,
        replicas=dict(sorted(Counter(r.replica for r in ok if r.replica).items())),
    )
