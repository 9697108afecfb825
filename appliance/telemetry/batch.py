"""One batch of engine records as rows: what the writer buffers (Record), the statements that
insert a batch in one transaction (with the rollup of the seconds it touches and the count
of records dropped since the last batch), and which failures the records themselves caused.

Holds no state: `insert_batch` runs on whichever thread owns the connection it is given (the
telemetry writer's thread). The iteration columns are the fields of IterationStats.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from sqlalchemy import insert
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError

from appliance.engine.stats import IterationStats, KnobChange, RequestStats
from appliance.telemetry import rollup
from appliance.telemetry.models import Iteration, KnobChangeRow, Request, TelemetryDrop

_INSERT_CHUNK = 5000  # rows per executemany inside one batch transaction
_ITERATION_FIELDS = tuple(f.name for f in fields(IterationStats))
_ITERATION_COLUMNS = ("replica_id", *_ITERATION_FIELDS)
_STARTED_AT = _ITERATION_COLUMNS.index("started_at")

# An IterationStats is buffered as a plain tuple of its field values: tuples of numbers and
# strings drop out of the garbage collector's tracking, so a full buffer does not lengthen GC
# pauses. Requests and knob changes are buffered as they are.
Record = tuple[Any, ...] | RequestStats | KnobChange
iteration_record = operator.attrgetter(*_ITERATION_FIELDS)


def insert_batch(conn: Connection, records: Iterable[Record], replica_id: str, new_drops: int) -> None:
    """Insert `records` as rows of `replica_id`, rebuild the rollup seconds their iterations
    fall in, and record `new_drops` (when nonzero) in telemetry_drops."""
    iterations: list[tuple[Any, ...]] = []
    requests: list[dict[str, Any]] = []
    knob_changes: list[dict[str, Any]] = []
    for record in records:
        if type(record) is tuple:
            iterations.append((replica_id, *record))
        else:
            row = dict(record.__dict__)
            row["replica_id"] = replica_id
            (requests if isinstance(record, RequestStats) else knob_changes).append(row)
    _insert_iterations(conn, iterations)
    for table, rows in ((Request.__table__, requests), (KnobChangeRow.__table__, knob_changes)):
        if rows:
            conn.execute(insert(table), rows)
    for lo, hi in rollup.second_ranges(row[_STARTED_AT] for row in iterations):
        rollup.rebuild(conn, lo, hi, replica_id)
    if new_drops:
        conn.execute(
            insert(TelemetryDrop.__table__),
            {"replica_id": replica_id, "at": time.time(), "count": new_drops},
        )


def is_bad_data(exc: Exception) -> bool:
    """Errors caused by the records themselves (retrying the same batch cannot help): the
    store's constraint and data errors, and a record of the wrong shape or type."""
    if isinstance(exc, (IntegrityError, DataError, TypeError, ValueError, AttributeError)):
        return True
    return isinstance(exc, StatementError) and not isinstance(exc, DBAPIError)


def _insert_iterations(conn: Connection, rows: list[tuple[Any, ...]]) -> None:
    """Insert (replica_id, *IterationStats fields) tuples. Iteration rows are the bulk of the
    store, so they skip SQLAlchemy's per-row parameter processing where the driver takes
    positional parameters (SQLite, psycopg)."""
    marker = {"qmark": "?", "format": "%s", "pyformat": "%s"}.get(conn.dialect.paramstyle)
    for start in range(0, len(rows), _INSERT_CHUNK):
        chunk = rows[start : start + _INSERT_CHUNK]
        if marker is None:
            conn.execute(
                insert(Iteration.__table__), [dict(zip(_ITERATION_COLUMNS, r, strict=True)) for r in chunk]
            )
        else:
            sql = "INSERT INTO iterations ({}) VALUES ({})".format(
                ", ".join(_ITERATION_COLUMNS), ", ".join([marker] * len(_ITERATION_COLUMNS))
            )
            conn.exec_driver_sql(sql, chunk)
