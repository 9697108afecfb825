"""How much telemetry to keep (Retention, parsed from "7d,1000000rows"-style text) and the
pruning transaction that enforces it.

Holds no state: `prune` runs on whichever thread owns the connection it is given (the
telemetry writer's thread, on a schedule) and deletes at most about one chunk per table per
call, keeping the per-second rollup in step inside the same transaction.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.engine import Connection

from appliance.telemetry import rollup
from appliance.telemetry.models import Iteration, Request, TelemetryDrop, iteration_rollups

PRUNE_CHUNK = 50_000  # rows per table deleted in one pruning transaction
_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_ROWS_RE = re.compile(r"^(\d+)rows?$")


@dataclass(frozen=True)
class Retention:
    """How much telemetry to keep. `max_age_s` prunes iteration, request and drop rows of
    every replica older than that; `max_rows` keeps the newest N iteration rows and the newest
    N request rows of the writer's own replica. Knob changes and runs are never pruned."""

    max_age_s: float | None = None
    max_rows: int | None = None

    def __post_init__(self) -> None:
        if self.max_age_s is not None and not self.max_age_s > 0:
            raise ValueError(f"retention max_age_s must be > 0, got {self.max_age_s!r}")
        if self.max_rows is not None and not self.max_rows > 0:
            raise ValueError(f"retention max_rows must be > 0, got {self.max_rows!r}")

    @property
    def enabled(self) -> bool:
        return self.max_age_s is not None or self.max_rows is not None


def parse_retention(text: str) -> Retention:
    """Parse "7d", "24h", "90m", "3600s", "2w", "1000000rows" or a comma-joined pair such as
    "7d,1000000rows". "" / "none" / "forever" keep everything."""
    cleaned = text.strip().lower()
    if cleaned in ("", "none", "forever", "off"):
        return Retention()
    age: float | None = None
    rows: int | None = None
    for part in (p.strip() for p in cleaned.split(",")):
        duration, count = _DURATION_RE.match(part), _ROWS_RE.match(part)
        if duration and age is None:
            age = float(duration.group(1)) * _DURATION_UNITS[duration.group(2)]
        elif count and rows is None:
            rows = int(count.group(1))
        else:
            raise ValueError(
                f"invalid retention {part!r} in {text!r}: expected an age like '7d', '24h', "
                "'90m', '3600s', a row count like '1000000rows', or one of each joined by ','"
            )
    try:
        return Retention(max_age_s=age, max_rows=rows)
    except ValueError as exc:
        raise ValueError(f"invalid retention {text!r}: {exc}") from None


def prune(conn: Connection, retention: Retention, replica_id: str, chunk: int = PRUNE_CHUNK) -> bool:
    """Delete rows beyond `retention` (see Retention), oldest first and at most about `chunk`
    rows per table, keeping the rollup in step. Returns True when more remain to delete (so a
    large backlog is pruned over several short transactions)."""
    it, req, drops = Iteration.__table__, Request.__table__, TelemetryDrop.__table__
    more = False
    if retention.max_age_s is not None:
        cutoff = time.time() - retention.max_age_s
        more |= _delete_older(conn, it.c.started_at, cutoff, None, chunk, rollup_too=True)
        more |= _delete_older(conn, req.c.finished, cutoff, None, chunk)
        conn.execute(delete(drops).where(drops.c.at < cutoff))
    if retention.max_rows is not None:
        for column in (it.c.started_at, req.c.finished):
            table = column.table
            oldest_kept = conn.execute(
                select(column)
                .where(table.c.replica_id == replica_id)
                .order_by(column.desc())
                .offset(retention.max_rows - 1)
                .limit(1)
            ).scalar()
            if oldest_kept is not None:
                more |= _delete_older(conn, column, oldest_kept, replica_id, chunk, rollup_too=table is it)
    return more


def _delete_older(
    conn: Connection,
    column: Any,
    cutoff: float,
    replica_id: str | None,
    chunk: int,
    *,
    rollup_too: bool = False,
) -> bool:
    """Delete rows with `column` < cutoff (of one replica, or all), oldest first, `chunk` of
    them (more only where timestamps tie); with `rollup_too` also the rollup rows they leave
    behind. Returns True when older rows may remain."""
    table = column.table
    scope = [] if replica_id is None else [table.c.replica_id == replica_id]
    nth_oldest = conn.execute(
        select(column).where(*scope).order_by(column).offset(chunk - 1).limit(1)
    ).scalar()
    more = nth_oldest is not None and nth_oldest < cutoff
    boundary = nth_oldest if more else cutoff
    conn.execute(delete(table).where(*scope, (column <= boundary) if more else (column < boundary)))
    if rollup_too:
        ru = iteration_rollups
        edge = math.floor(boundary)
        rollup_scope = [] if replica_id is None else [ru.c.replica_id == replica_id]
        conn.execute(delete(ru).where(*rollup_scope, ru.c.second < edge))
        rollup.rebuild(conn, edge, edge + 1, replica_id)
    return more
