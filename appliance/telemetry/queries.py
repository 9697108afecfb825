"""Read-side queries of the telemetry store, for the dashboard, reports and the CLI.

Every function takes a SQLAlchemy Engine (or a URL; an engine made for a URL is disposed
after the call), works on SQLite and PostgreSQL, and returns plain data. Times are epoch
seconds. `replica_id=None` means all replicas together.

Downsampling is done in SQL (GROUP BY over an integer bucket expression). Windows longer
than RAW_MAX_SPAN_S, or with buckets of a second or more, are served from the per-second
rollup table: the window is then widened to whole seconds and buckets are whole seconds, so
each bucket's min/mean/max are exact for the rows in it. Shorter windows read raw rows.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Double, bindparam, func, select
from sqlalchemy.engine import Connection, CursorResult, Engine

from appliance.numeric import percentile
from appliance.records import COMPLETED_REASONS, HoldCause, RunStatus
from appliance.telemetry.models import (
    SERIES_COLUMNS,
    Iteration,
    KnobChangeRow,
    Request,
    Run,
    TelemetryDrop,
    iteration_rollups,
)
from appliance.telemetry.rollup import floor_int
from appliance.telemetry.store import using_engine

RAW_MAX_SPAN_S = 120.0
DEFAULT_WINDOW_S = 3600.0
LATENCY_METRICS = ("ttft", "e2e", "itl", "queue")


@dataclass(frozen=True)
class SeriesPoint:
    t: float  # bucket start
    count: int  # iteration rows in the bucket
    min: float
    mean: float
    max: float
    sum: float


@dataclass(frozen=True)
class Series:
    column: str
    since: float  # window actually covered (widened to whole seconds for "rollup")
    until: float
    bucket_s: float
    resolution: str  # "raw" or "rollup"
    points: list[SeriesPoint]  # buckets without rows are left out


@dataclass(frozen=True)
class LatencyPoint:
    t: float  # bucket start (requests bucketed by their finish time)
    count: int
    mean: float
    quantiles: dict[str, float]  # e.g. {"p50": ..., "p90": ..., "p99": ...}


def iteration_series(
    target: Engine | str,
    column: str,
    since: float | None = None,
    until: float | None = None,
    *,
    replica_id: str | None = None,
    run_id: str | None = None,
    points: int = 500,
    resolution: str = "auto",
) -> Series:
    """min/mean/max/sum per bucket of iteration `column` over [since, until), at most
    `points` buckets. With `run_id` the window defaults to the run's and the replica to the
    run's replica. `resolution` is "auto", "raw" or "rollup"."""
    return iteration_series_many(target, [column], since, until, replica_id=replica_id, run_id=run_id,
                                 points=points, resolution=resolution)[column]


def iteration_series_many(
    target: Engine | str,
    columns: Sequence[str],
    since: float | None = None,
    until: float | None = None,
    *,
    replica_id: str | None = None,
    run_id: str | None = None,
    points: int = 500,
    resolution: str = "auto",
) -> dict[str, Series]:
    """`iteration_series` of several columns over the same buckets, read in ONE query (one
    scan of the window instead of one per column): {column: Series}."""
    columns = list(dict.fromkeys(columns))
    unknown = [c for c in columns if c not in SERIES_COLUMNS]
    if unknown or not columns:
        raise ValueError(f"unknown iteration column {(unknown or [None])[0]!r}; "
                         f"choose from {', '.join(SERIES_COLUMNS)}")
    if not isinstance(points, int) or points < 1:
        raise ValueError(f"points must be a positive integer, got {points!r}")
    if resolution not in ("auto", "raw", "rollup"):
        raise ValueError(f"resolution must be 'auto', 'raw' or 'rollup', got {resolution!r}")
    with using_engine(target) as engine, engine.connect() as conn:
        since, until, replica_id = _window(conn, since, until, replica_id, run_id)
        span = until - since
        if resolution == "auto":
            resolution = "raw" if span <= RAW_MAX_SPAN_S and span / points < 1.0 else "rollup"
        if resolution == "raw":
            return _raw_series(conn, columns, since, until, replica_id, points)
        return _rollup_series(conn, columns, since, until, replica_id, points)


def _raw_series(
    conn: Connection, columns: list[str], since: float, until: float, replica_id: str | None, points: int
) -> dict[str, Series]:
    it = Iteration.__table__
    width = (until - since) / points
    offset = (it.c.started_at - bindparam("since", since, Double)) / bindparam("width", width, Double)
    bucket = floor_int(offset, conn.dialect.name).label("b")
    aggregates = [agg for c in columns for agg in (func.min(it.c[c]), func.max(it.c[c]), func.sum(it.c[c]))]
    rows = _buckets(conn, bucket, func.count(), aggregates, it.c.started_at, since, until, replica_id)
    merged: dict[str, dict[int, list[float]]] = {c: {} for c in columns}
    for b, n, *stats in rows:
        b = min(int(b), points - 1)  # a value just below `until` may round into bucket `points`
        for i, column in enumerate(columns):
            lo, hi, total = stats[3 * i:3 * i + 3]
            acc = merged[column].get(b)
            if acc is not None:
                merged[column][b] = [acc[0] + n, min(acc[1], lo), max(acc[2], hi), acc[3] + total]
            else:
                merged[column][b] = [n, lo, hi, total]
    return {c: Series(c, since, until, width, "raw", _points(merged[c], since, width)) for c in columns}


def _rollup_series(
    conn: Connection, columns: list[str], since: float, until: float, replica_id: str | None, points: int
) -> dict[str, Series]:
    ru = iteration_rollups
    origin, end = math.floor(since), math.ceil(until)
    end = max(end, origin + 1)
    width = max(1, math.ceil((end - origin) / points))
    offset = (ru.c.second - origin) / bindparam("width", float(width), Double)
    bucket = floor_int(offset, conn.dialect.name).label("b")
    aggregates = [agg for c in columns for agg in (
        func.min(ru.c[f"{c}_min"]), func.max(ru.c[f"{c}_max"]), func.sum(ru.c[f"{c}_sum"]))]
    rows = _buckets(conn, bucket, func.sum(ru.c.n), aggregates, ru.c.second, origin, end, replica_id)
    merged: dict[str, dict[int, list[float]]] = {c: {} for c in columns}
    for b, n, *stats in rows:
        for i, column in enumerate(columns):
            merged[column][int(b)] = [n, *stats[3 * i:3 * i + 3]]
    return {c: Series(c, float(origin), float(end), float(width), "rollup", _points(merged[c], origin, width))
            for c in columns}


def _buckets(conn: Connection, bucket: ColumnElement, count: ColumnElement, aggregates: list[ColumnElement],
             time_column: Any, lo: float, hi: float, replica_id: str | None) -> CursorResult[Any]:
    """(bucket, count, *aggregates) rows of `time_column`'s table with lo <= time < hi (of one
    replica, or all), one per bucket, in bucket order."""
    query = (
        select(bucket, count, *aggregates)
        .where(time_column >= lo, time_column < hi)
        .group_by(bucket)
        .order_by(bucket)
    )
    if replica_id is not None:
        query = query.where(time_column.table.c.replica_id == replica_id)
    return conn.execute(query)


def _points(merged: dict[int, list[float]], origin: float, width: float) -> list[SeriesPoint]:
    return [
        SeriesPoint(
            t=origin + b * width,
            count=int(n),
            min=float(lo),
            mean=float(total) / n,
            max=float(hi),
            sum=float(total),
        )
        for b, (n, lo, hi, total) in sorted(merged.items())
    ]


@dataclass(frozen=True)
class HeldTime:
    """Queued request-time by the limit that held it: per bucket and over the whole window.

    An iteration with `held_by_<cause>` = n and step time d adds n x d request-seconds to that
    cause (the n requests waited through it)."""

    since: float
    until: float
    bucket_s: float
    points: list[tuple[float, dict[HoldCause, float]]]  # (bucket start, request-seconds by cause)
    totals: dict[HoldCause, float]  # request-seconds by cause over the window


def held_time(
    target: Engine | str,
    since: float | None = None,
    until: float | None = None,
    *,
    replica_id: str | None = None,
    run_id: str | None = None,
    points: int = 60,
) -> HeldTime:
    """Queued request-seconds by HoldCause over [since, until) in at most `points` buckets, in
    one aggregate query over the raw iteration rows (the rollup has no per-row products)."""
    if not isinstance(points, int) or points < 1:
        raise ValueError(f"points must be a positive integer, got {points!r}")
    it = Iteration.__table__
    with using_engine(target) as engine, engine.connect() as conn:
        since, until, replica_id = _window(conn, since, until, replica_id, run_id)
        width = (until - since) / points
        offset = (it.c.started_at - bindparam("since", since, Double)) / bindparam("width", width, Double)
        bucket = floor_int(offset, conn.dialect.name).label("b")
        sums = [func.coalesce(func.sum(it.c[cause.column] * it.c.duration_s), 0.0) for cause in HoldCause]
        query = (select(bucket, *sums).where(it.c.started_at >= since, it.c.started_at < until)
                 .group_by(bucket).order_by(bucket))
        if replica_id is not None:
            query = query.where(it.c.replica_id == replica_id)
        merged: dict[int, dict[HoldCause, float]] = {}
        for b, *values in conn.execute(query):
            acc = merged.setdefault(min(int(b), points - 1), dict.fromkeys(HoldCause, 0.0))
            for cause, value in zip(HoldCause, values):
                acc[cause] += float(value)
    totals = {cause: sum(v[cause] for v in merged.values()) for cause in HoldCause}
    return HeldTime(since, until, width, [(since + b * width, v) for b, v in sorted(merged.items())], totals)


def replicas(target: Engine | str, since: float, until: float) -> list[str]:
    """The replica ids with iterations in [since, until), sorted (a fleet's members; one id on one box)."""
    it = Iteration.__table__
    query = (select(it.c.replica_id).where(it.c.started_at >= since, it.c.started_at < until)
             .group_by(it.c.replica_id).order_by(it.c.replica_id))
    with using_engine(target) as engine, engine.connect() as conn:
        return [row[0] for row in conn.execute(query)]


def latest(target: Engine | str, replica_id: str | None = None) -> dict[str, Any]:
    """The newest iteration row (or None) and row counts, for the dashboard's header."""
    it, req, kc = Iteration.__table__, Request.__table__, KnobChangeRow.__table__
    runs, drops = Run.__table__, TelemetryDrop.__table__

    def scoped(query: Any, table: Any) -> Any:
        return query if replica_id is None else query.where(table.c.replica_id == replica_id)

    with using_engine(target) as engine, engine.connect() as conn:
        row = conn.execute(scoped(select(it), it).order_by(it.c.started_at.desc()).limit(1)).first()
        counts = {
            name: conn.execute(scoped(select(func.count()).select_from(table), table)).scalar_one()
            for name, table in (("iterations", it), ("requests", req), ("knob_changes", kc), ("runs", runs))
        }
        counts["runs_running"] = conn.execute(
            scoped(select(func.count()).select_from(runs), runs).where(runs.c.status == RunStatus.RUNNING)
        ).scalar_one()
        counts["rows_dropped"] = int(
            conn.execute(scoped(select(func.coalesce(func.sum(drops.c.count), 0)), drops)).scalar_one()
        )
    return {"iteration": dict(row._mapping) if row else None, **counts}


def run_summary(target: Engine | str, run_id: str) -> dict[str, Any]:
    """Server-side figures of a run from its requests rows: counts by finish reason, token
    totals, throughput over the run's span, and TTFT / ITL / E2E / queue statistics.

    TTFT = first_token - arrival; ITL = (finished - first_token) / (output_tokens - 1) for
    requests with more than one output token; E2E = finished - arrival for requests that
    ended with stop or length; queue = first_scheduled - arrival.
    """
    req = Request.__table__
    with using_engine(target) as engine, engine.connect() as conn:
        rows = conn.execute(
            select(
                req.c.arrival,
                req.c.first_scheduled,
                req.c.first_token,
                req.c.finished,
                req.c.prompt_tokens,
                req.c.output_tokens,
                req.c.finish_reason,
            ).where(req.c.run_id == run_id)
        ).all()
    reasons: dict[str, int] = defaultdict(int)
    ttft, itl, e2e, queue = [], [], [], []
    for arrival, scheduled, first, finished, _prompt, out, reason in rows:
        reasons[reason] += 1
        if first is not None:
            ttft.append(first - arrival)
            if out > 1:
                itl.append((finished - first) / (out - 1))
        if scheduled is not None:
            queue.append(scheduled - arrival)
        if reason in COMPLETED_REASONS:
            e2e.append(finished - arrival)
    span = (max(r.finished for r in rows) - min(r.arrival for r in rows)) if rows else 0.0
    output_tokens = sum(r.output_tokens for r in rows)
    return {
        "run_id": run_id,
        "requests": len(rows),
        "finish_reasons": dict(reasons),
        "prompt_tokens": sum(r.prompt_tokens for r in rows),
        "output_tokens": output_tokens,
        "duration_s": span,
        "output_tokens_per_s": output_tokens / span if span > 0 else None,
        "requests_per_s": len(rows) / span if span > 0 else None,
        "ttft_s": _stats(ttft),
        "itl_s": _stats(itl),
        "e2e_s": _stats(e2e),
        "queue_s": _stats(queue),
    }


def knob_timeline(
    target: Engine | str,
    since: float | None = None,
    until: float | None = None,
    *,
    replica_id: str | None = None,
) -> list[dict[str, Any]]:
    """Applied knob changes, oldest first, each with who made it, why and what was predicted."""
    kc = KnobChangeRow.__table__
    query = select(
        kc.c.replica_id, kc.c.version, kc.c.iteration, kc.c.applied_at, kc.c.old, kc.c.new, kc.c.source,
        kc.c.reason, kc.c.prediction,
    ).order_by(kc.c.applied_at, kc.c.id)
    if since is not None:
        query = query.where(kc.c.applied_at >= since)
    if until is not None:
        query = query.where(kc.c.applied_at < until)
    if replica_id is not None:
        query = query.where(kc.c.replica_id == replica_id)
    with using_engine(target) as engine, engine.connect() as conn:
        return [dict(row._mapping) for row in conn.execute(query)]


def latency_series(
    target: Engine | str,
    metric: str = "ttft",
    since: float | None = None,
    until: float | None = None,
    *,
    replica_id: str | None = None,
    run_id: str | None = None,
    points: int = 60,
    quantiles: Sequence[float] = (0.5, 0.9, 0.99),
) -> list[LatencyPoint]:
    """Request latency percentiles per time bucket (requests bucketed by finish time).
    `metric` is one of LATENCY_METRICS (see run_summary for definitions). With `run_id`
    only that run's requests count and the window defaults to the run's."""
    if metric not in LATENCY_METRICS:
        raise ValueError(f"unknown latency metric {metric!r}; choose from {', '.join(LATENCY_METRICS)}")
    if not isinstance(points, int) or points < 1:
        raise ValueError(f"points must be a positive integer, got {points!r}")
    bad = [q for q in quantiles if not 0 <= q <= 1]
    if bad:
        raise ValueError(f"quantiles must lie in [0, 1], got {bad}")
    req = Request.__table__
    value = {
        "ttft": req.c.first_token - req.c.arrival,
        "e2e": req.c.finished - req.c.arrival,
        "itl": (req.c.finished - req.c.first_token) / (req.c.output_tokens - 1),
        "queue": req.c.first_scheduled - req.c.arrival,
    }[metric].label("v")
    with using_engine(target) as engine, engine.connect() as conn:
        since, until, replica_id = _window(conn, since, until, replica_id, run_id)
        width = (until - since) / points
        offset = (req.c.finished - bindparam("since", since, Double)) / bindparam("width", width, Double)
        bucket = floor_int(offset, conn.dialect.name).label("b")
        query = (
            select(bucket, value)
            .where(req.c.finished >= since, req.c.finished < until, value.element.is_not(None))
            .order_by(bucket, value.element)
        )
        if metric == "itl":
            query = query.where(req.c.output_tokens > 1)
        if metric == "e2e":
            query = query.where(req.c.finish_reason.in_(COMPLETED_REASONS))
        if replica_id is not None:
            query = query.where(req.c.replica_id == replica_id)
        if run_id is not None:
            query = query.where(req.c.run_id == run_id)
        buckets: dict[int, list[float]] = defaultdict(list)
        for b, v in conn.execute(query):
            buckets[min(int(b), points - 1)].append(float(v))
    result = []
    for b, values in sorted(buckets.items()):
        values.sort()
        result.append(
            LatencyPoint(
                t=since + b * width,
                count=len(values),
                mean=sum(values) / len(values),
                quantiles={_quantile_name(q): percentile(values, q * 100) for q in quantiles},
            )
        )
    return result


def _window(
    conn: Connection,
    since: float | None,
    until: float | None,
    replica_id: str | None,
    run_id: str | None,
) -> tuple[float, float, str | None]:
    """Resolve the defaults of a query window (the run's window and replica with run_id)."""
    if run_id is not None:
        runs = Run.__table__
        run = conn.execute(
            select(runs.c.replica_id, runs.c.started_at, runs.c.ended_at).where(runs.c.id == run_id)
        ).first()
        if run is None:
            raise LookupError(f"no run {run_id!r}")
        replica_id = replica_id if replica_id is not None else run.replica_id
        since = since if since is not None else run.started_at
        if until is None:
            until = run.ended_at if run.ended_at is not None else time.time()
    until = float(until) if until is not None else time.time()
    since = float(since) if since is not None else until - DEFAULT_WINDOW_S
    if not until > since:
        raise ValueError(f"until ({until}) must be after since ({since})")
    return since, until, replica_id


def _quantile_name(q: float) -> str:
    return f"p{q * 100:g}"


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    values = sorted(values)
    return {
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": values[-1],
    }
