"""The per-second iteration rollup (iteration_rollups) and the integer bucketing it shares
with the queries. Rollup rows are rebuilt from the raw rows for the seconds a change touched,
in the same transaction, so they always agree with the iterations table."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

from sqlalchemy import BigInteger, ColumnElement, Delete, Insert, bindparam, cast, delete, func, insert, select
from sqlalchemy.engine import Connection

from appliance.telemetry.models import ROLLUP_STATS, SERIES_COLUMNS, Iteration, iteration_rollups

_AGGREGATES = {"min": func.min, "max": func.max, "sum": func.sum}


def floor_int(expr: ColumnElement, dialect_name: str) -> ColumnElement:
    """floor(expr) as an integer. On SQLite a CAST truncates, which is floor for the
    non-negative values it is used on here (epoch seconds, offsets from a window start)."""
    if dialect_name == "sqlite":
        return cast(expr, BigInteger)
    return cast(func.floor(expr), BigInteger)


def second_ranges(started_at: Iterable[float]) -> list[tuple[int, int]]:
    """Collapse the whole seconds that `started_at` values fall in into [lo, hi) ranges."""
    seconds = sorted({math.floor(t) for t in started_at})
    ranges: list[tuple[int, int]] = []
    for sec in seconds:
        if ranges and ranges[-1][1] == sec:
            ranges[-1] = (ranges[-1][0], sec + 1)
        else:
            ranges.append((sec, sec + 1))
    return ranges


def rebuild(conn: Connection, lo: int, hi: int, replica_id: str | None = None) -> None:
    """Recompute the rollup rows of seconds [lo, hi) from the raw rows (one replica or all)."""
    stale, fresh = _rebuild_statements(conn.dialect.name, replica_id is not None)
    params = {"lo": lo, "hi": hi} if replica_id is None else {"lo": lo, "hi": hi, "replica_id": replica_id}
    conn.execute(stale, params)
    conn.execute(fresh, params)


@functools.cache
def _rebuild_statements(dialect_name: str, one_replica: bool) -> tuple[Delete, Insert]:
    """`rebuild`'s delete and insert-from-select, with the seconds (`lo`, `hi`) and the replica
    (`replica_id`) as bound parameters, built once per dialect and scope (one replica or all): built
    afresh each round, their aggregates made a telemetry write round's Python cost four times over
    (about 1 ms a round, on the writer's thread, beside the engine's)."""
    it = Iteration.__table__
    ru = iteration_rollups
    stale = delete(ru).where(ru.c.second >= bindparam("lo"), ru.c.second < bindparam("hi"))
    source = [it.c.started_at >= bindparam("lo"), it.c.started_at < bindparam("hi")]
    if one_replica:
        stale = stale.where(ru.c.replica_id == bindparam("replica_id"))
        source.append(it.c.replica_id == bindparam("replica_id"))
    second = floor_int(it.c.started_at, dialect_name)
    columns = ["replica_id", "second", "n"]
    exprs: list[ColumnElement] = [it.c.replica_id, second, func.count()]
    for name in SERIES_COLUMNS:
        for stat in ROLLUP_STATS:
            columns.append(f"{name}_{stat}")
            exprs.append(_AGGREGATES[stat](it.c[name]))
    rows = select(*exprs).where(*source).group_by(it.c.replica_id, second)
    return stale, insert(ru).from_select(columns, rows)
