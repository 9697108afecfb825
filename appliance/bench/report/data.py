"""What a report needs of one stored run, read from the telemetry store.

The client's view (the run row, its summary and per-request results) comes from
`appliance.telemetry.runs`; the server's view (its `requests` rows joined by run id, the
ITERATION rows of the run's replica within the run's start..end, the knob changes in that
window) from `appliance.telemetry.queries` and the aggregate query here.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import Double, case, cast, func, select
from sqlalchemy.engine import Engine

from appliance.bench.metrics import Distribution
from appliance.telemetry import queries, request_split, runs
from appliance.telemetry.models import Iteration, Request
from appliance.telemetry.store import using_engine

SERIES = ("running", "waiting", "max_num_seqs", "kv_blocks_used", "kv_blocks_total",
          "prefill_tokens", "decode_tokens", "padding_tokens", "token_budget")
SERIES_POINTS = 300
BUDGET_FULL = 0.9  # an iteration "fills" the token budget at >= 90 % of it
KV_PINNED = 0.95  # the KV cache is "pinned" at >= 95 % of its blocks
LATENCIES = ("ttft", "tpot", "itl", "e2e")
WORST = 5  # the slowest requests (by E2E) whose time the report splits


@dataclass(frozen=True)
class IterationTotals:
    """Aggregates of the run's iteration rows (zeros when there are none)."""

    iterations: int
    busy_s: float  # summed iteration wall time
    scheduled_tokens: int  # real work: prefill + decode tokens
    prefill_tokens: int
    decode_tokens: int
    padding_tokens: int  # rows computed only as padding (static policy's convoy)
    preemptions: int
    budget_use_mean: float | None  # mean of scheduled_tokens / token_budget
    budget_full_share: float | None  # share of iterations at >= BUDGET_FULL of the budget
    waiting_share: float | None  # share of iterations that left requests waiting
    kv_use_max: float | None  # peak kv_blocks_used / kv_blocks_total
    kv_pinned_share: float | None  # share of iterations at >= KV_PINNED of the cache
    running_max: int
    waiting_max: int
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of which served from it

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Share of the tokens looked up at admission that the prefix cache served."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None

    @property
    def padding_share(self) -> float | None:
        """Share of the computed rows that were padding."""
        total = self.scheduled_tokens + self.padding_tokens
        return self.padding_tokens / total if total else None


@dataclass(frozen=True)
class SeriesData:
    """One iteration column over the run: bucket start (s from the run start) and mean/max."""

    t: list[float]
    mean: list[float]
    max: list[float]


@dataclass
class RunData:
    """Everything the report shows of one run."""

    run: dict[str, Any]  # the runs row (its "requests" list attached)
    summary: dict[str, Any]  # the client-side figures (metrics.Summary.as_dict shape)
    knobs: dict[str, Any]  # knob values in force when the run started
    fixed: dict[str, Any]  # fixed server settings (block size, KV blocks, model...)
    knob_changes: list[dict[str, Any]]  # applied during the run, oldest first
    server: dict[str, Any]  # queries.run_summary: the server's own requests rows
    totals: IterationTotals
    series: dict[str, SeriesData] = field(default_factory=dict)
    queue_s: list[float] = field(default_factory=list)  # server queue time per request, by arrival
    worst: list[request_split.RequestSplit] = field(default_factory=list)  # slowest by E2E, split

    @property
    def run_id(self) -> str:
        return self.run["id"]

    @property
    def name(self) -> str:
        return self.run["name"]

    @property
    def duration_s(self) -> float:
        return float(self.summary.get("duration_s") or 0.0)


def load_run(target: Engine | str, run_id: str, *, series: bool = True) -> RunData:
    """Read one run and its server-side telemetry; LookupError when there is no such run."""
    with using_engine(target) as engine:
        run = runs.get_run(engine, run_id, with_requests=True)
        if run is None:
            raise LookupError(f"no run {run_id!r} in the telemetry store")
        until = run["ended_at"] if run["ended_at"] is not None else time.time()
        since, replica = run["started_at"], run["replica_id"]
        stored = run["summary"] or {}
        payload = run["knobs"] or {}
        changes = queries.knob_timeline(engine, since, until, replica_id=replica)
        if not changes:  # a server without telemetry still reports its changes to the client
            changes = list(stored.get("knob_changes") or [])
        data = RunData(
            run=run,
            summary=stored.get("summary") or client_summary(run, until - since),
            knobs=dict(payload.get("knobs", payload)) if isinstance(payload, dict) else {},
            fixed=dict(payload.get("fixed") or {}) if isinstance(payload, dict) else {},
            knob_changes=changes,
            server=queries.run_summary(engine, run_id),
            totals=iteration_totals(engine, replica, since, until),
            queue_s=queue_times(engine, run_id),
            worst=[request_split.request_split(engine, r["id"])
                   for r in request_split.slowest_requests(engine, run_id=run_id, limit=WORST)],
        )
        if series and data.totals.iterations and until > since:
            data.series = {
                column: _series(engine, column, run_id, since) for column in SERIES
            }
    return data


def client_summary(run: dict[str, Any], duration_s: float) -> dict[str, Any]:
    """Client-side figures rebuilt from the per-request rows of a run stored without a summary
    (a run that failed or was interrupted)."""
    ok = [r for r in run.get("requests", []) if r["ok"]]
    duration_s = max(duration_s, 1e-9)
    output = sum(r["output_tokens"] or 0 for r in ok)
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)

    def dist(values: list[float]) -> dict[str, Any]:
        return asdict(Distribution.of(values))

    return {
        "num_requests": len(run.get("requests", [])),
        "completed": len(ok),
        "failed": len(run.get("requests", [])) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
        "ttft": dist([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "tpot": dist([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
        "itl": dist([g for r in ok for g in (r["itl_s"] or [])]),
        "e2e": dist([r["e2e_s"] for r in ok if r["e2e_s"] is not None]),
        "goodput": None,
        "slo": None,
        "errors": {},
    }


def iteration_totals(target: Engine | str, replica_id: str, since: float, until: float) -> IterationTotals:
    """Aggregate the iteration rows of `replica_id` that started within [since, until]."""
    it = Iteration.__table__
    ratio = cast(it.c.scheduled_tokens, Double) / it.c.token_budget
    kv = cast(it.c.kv_blocks_used, Double) / it.c.kv_blocks_total

    def share(condition: Any) -> Any:
        return func.sum(case((condition, 1), else_=0))

    query = select(
        func.count(),
        func.coalesce(func.sum(it.c.duration_s), 0.0),
        func.coalesce(func.sum(it.c.scheduled_tokens), 0),
        func.coalesce(func.sum(it.c.prefill_tokens), 0),
        func.coalesce(func.sum(it.c.decode_tokens), 0),
        func.coalesce(func.sum(it.c.padding_tokens), 0),
        func.coalesce(func.sum(it.c.preemptions), 0),
        func.avg(ratio),
        share(ratio >= BUDGET_FULL),
        share(it.c.waiting > 0),
        func.max(kv),
        share(kv >= KV_PINNED),
        func.coalesce(func.max(it.c.running), 0),
        func.coalesce(func.max(it.c.waiting), 0),
        func.coalesce(func.sum(it.c.prefix_cache_queries), 0),
        func.coalesce(func.sum(it.c.prefix_cache_hits), 0),
    ).where(it.c.replica_id == replica_id, it.c.started_at >= since, it.c.started_at <= until)
    with using_engine(target) as engine, engine.connect() as conn:
        row = conn.execute(query).one()
    n = int(row[0])

    def frac(value: Any) -> float | None:
        return float(value) / n if n else None

    return IterationTotals(
        iterations=n, busy_s=float(row[1]), scheduled_tokens=int(row[2]),
        prefill_tokens=int(row[3]), decode_tokens=int(row[4]), padding_tokens=int(row[5]),
        preemptions=int(row[6]), budget_use_mean=None if row[7] is None else float(row[7]),
        budget_full_share=frac(row[8]), waiting_share=frac(row[9]),
        kv_use_max=None if row[10] is None else float(row[10]), kv_pinned_share=frac(row[11]),
        running_max=int(row[12]), waiting_max=int(row[13]),
        prefix_cache_queries=int(row[14]), prefix_cache_hits=int(row[15]),
    )


def queue_times(target: Engine | str, run_id: str) -> list[float]:
    """Server-side queue time (first scheduled - arrival) of the run's requests, by arrival."""
    req = Request.__table__
    query = (
        select(req.c.first_scheduled - req.c.arrival)
        .where(req.c.run_id == run_id, req.c.first_scheduled.is_not(None))
        .order_by(req.c.arrival)
    )
    with using_engine(target) as engine, engine.connect() as conn:
        return [float(v) for (v,) in conn.execute(query)]


def _series(engine: Engine, column: str, run_id: str, origin: float) -> SeriesData:
    series = queries.iteration_series(engine, column, run_id=run_id, points=SERIES_POINTS)
    return SeriesData(
        t=[p.t - origin for p in series.points],
        mean=[p.mean for p in series.points],
        max=[p.max for p in series.points],
    )


def server_request_count(target: Engine | str, run_id: str) -> int:
    """How many of the run's requests the server has recorded so far."""
    req = Request.__table__
    with using_engine(target) as engine, engine.connect() as conn:
        return int(conn.execute(select(func.count()).where(req.c.run_id == run_id)).scalar_one())


def wait_for_server_rows(target: Engine | str, run_id: str, expected: int, timeout_s: float = 10.0,
                         settle_s: float = 0.6) -> bool:
    """Wait until the server's telemetry writer has stored `expected` requests rows of the run,
    then `settle_s` more for the iteration rows flushed alongside. False on timeout."""
    deadline = time.monotonic() + timeout_s
    with using_engine(target) as engine:
        while server_request_count(engine, run_id) < expected:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
    time.sleep(settle_s)
    return True
