"""Load-test and sweep runs in the telemetry store: their settings, status, summary, and the
client-side result of each request. Every function takes an Engine or a URL."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Connection, Engine

from appliance.records import FINAL_STATUSES, RunStatus
from appliance.telemetry.models import Run, RunRequest
from appliance.telemetry.store import using_engine

_RUN_REQUEST_FIELDS = frozenset(
    c.name for c in RunRequest.__table__.columns if c.name not in ("id", "run_id")
)
_REQUIRED_FIELDS = frozenset({"index", "ok"})



@contextmanager
def _writing(target: Engine | str) -> Iterator[Connection]:
    """A write transaction that takes SQLite's write lock at BEGIN (IMMEDIATE), so a
    read-then-write never fails with "database is locked" when another writer commits between."""
    with using_engine(target) as engine:
        with engine.connect().execution_options(sqlite_begin="IMMEDIATE") as conn, conn.begin():
            yield conn

def create_run(
    target: Engine | str,
    name: str,
    workload: str,
    arrival: Mapping[str, Any],
    knobs: Mapping[str, Any],
    replica_id: str,
    *,
    run_id: str | None = None,
    started_at: float | None = None,
) -> str:
    """Record a new run with status "running"; returns its id (a uuid4 string by default)."""
    run_id = run_id or str(uuid.uuid4())
    with _writing(target) as conn:
        conn.execute(
            insert(Run.__table__).values(
                id=run_id,
                replica_id=replica_id,
                name=name,
                workload=workload,
                arrival=dict(arrival),
                knobs=dict(knobs),
                started_at=time.time() if started_at is None else started_at,
                ended_at=None,
                status=RunStatus.RUNNING,
                summary=None,
            )
        )
    return run_id


def add_run_requests(target: Engine | str, run_id: str, rows: Iterable[Mapping[str, Any]]) -> int:
    """Store client-side request results of a run. Each row needs `index` and `ok` and may
    carry request_id, error_kind, prompt_tokens, output_tokens, requested_output_tokens,
    ttft_s, e2e_s, tpot_s, itl_s (list), itl_mean_s, itl_p50_s, itl_p99_s, start_offset_s.
    Returns the number of rows stored."""
    records = []
    for position, row in enumerate(rows):
        unknown = set(row) - _RUN_REQUEST_FIELDS
        missing = _REQUIRED_FIELDS - set(row)
        if unknown or missing:
            problems = []
            if unknown:
                problems.append(f"unknown fields {sorted(unknown)}")
            if missing:
                problems.append(f"missing fields {sorted(missing)}")
            raise ValueError(f"run request row {position}: {'; '.join(problems)}")
        record = {name: None for name in _RUN_REQUEST_FIELDS}
        record.update(row)
        record["run_id"] = run_id
        if record["itl_s"] is not None:
            record["itl_s"] = [float(x) for x in record["itl_s"]]
        records.append(record)
    if not records:
        return 0
    with _writing(target) as conn:
        _require_run(conn, run_id)
        conn.execute(insert(RunRequest.__table__), records)
    return len(records)


def finish_run(
    target: Engine | str,
    run_id: str,
    status: RunStatus | str,
    summary: Mapping[str, Any] | None = None,
    *,
    ended_at: float | None = None,
) -> None:
    """Set a run's final status (completed, cancelled, failed or interrupted), end time and
    summary figures."""
    if status not in FINAL_STATUSES:
        raise ValueError(f"run status must be one of {', '.join(FINAL_STATUSES)}, got {status!r}")
    runs = Run.__table__
    with _writing(target) as conn:
        _require_run(conn, run_id)
        conn.execute(
            update(runs)
            .where(runs.c.id == run_id)
            .values(
                status=status,
                ended_at=time.time() if ended_at is None else ended_at,
                summary=dict(summary) if summary is not None else None,
            )
        )


def get_run(target: Engine | str, run_id: str, *, with_requests: bool = False) -> dict[str, Any] | None:
    """A run as a dict (with a "requests" list ordered by index when asked), or None."""
    runs, rr = Run.__table__, RunRequest.__table__
    with using_engine(target) as engine, engine.connect() as conn:
        row = conn.execute(select(runs).where(runs.c.id == run_id)).first()
        if row is None:
            return None
        run = dict(row._mapping)
        if with_requests:
            columns = [c for c in rr.columns if c.name != "id"]
            run["requests"] = [
                dict(r._mapping)
                for r in conn.execute(select(*columns).where(rr.c.run_id == run_id).order_by(rr.c.index))
            ]
    return run


def list_runs(
    target: Engine | str,
    *,
    replica_id: str | None = None,
    status: RunStatus | str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    """Runs, newest first."""
    if status is not None and status not in tuple(RunStatus):
        raise ValueError(f"run status must be one of {', '.join(RunStatus)}, got {status!r}")
    runs = Run.__table__
    query = select(runs).order_by(runs.c.started_at.desc()).limit(limit)
    if replica_id is not None:
        query = query.where(runs.c.replica_id == replica_id)
    if status is not None:
        query = query.where(runs.c.status == status)
    with using_engine(target) as engine, engine.connect() as conn:
        return [dict(row._mapping) for row in conn.execute(query)]


def mark_interrupted_runs(target: Engine | str, replica_id: str | None = None) -> int:
    """Mark runs still "running" (of one replica, or all) as "interrupted"; returns how many.
    The server calls this at start: a run cannot survive the process that drove it."""
    runs = Run.__table__
    query = (update(runs).where(runs.c.status == RunStatus.RUNNING)
             .values(status=RunStatus.INTERRUPTED, ended_at=time.time()))
    if replica_id is not None:
        query = query.where(runs.c.replica_id == replica_id)
    with _writing(target) as conn:
        return conn.execute(query).rowcount


def _require_run(conn: Any, run_id: str) -> None:
    runs = Run.__table__
    if conn.execute(select(runs.c.id).where(runs.c.id == run_id)).first() is None:
        raise LookupError(f"no run {run_id!r}")
