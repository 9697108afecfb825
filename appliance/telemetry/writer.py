"""TelemetryWriter: the engine's stats sink that persists records off the hot path.

The engine calls on_iteration / on_request / on_knob_change inline; each only appends the
record to a bounded in-memory buffer under a lock that is never held across I/O. A writer
thread takes everything buffered once per `flush_interval_s` and inserts it in one
transaction (plus the per-second rollup of the new iteration rows), prunes old rows per the
retention policy, and survives a store that is locked, read-only, deleted or full: it retries
with backoff, logs once per `log_interval_s`, drops the oldest rows when the buffer overflows
(counted in `rows_dropped` and, once the store works again, in the telemetry_drops table) and
resumes by itself. A SQLite file that is deleted or replaced while open is detected (by inode)
and recreated at the head revision. A store that lacks columns the models write (the models and
the migrations disagree: a bug, not an outage) is reported once as an error, and its records
are dropped and counted at once instead of being held and retried.
"""

from __future__ import annotations

import logging
import math
import operator
import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError

from appliance.engine.stats import IterationStats, KnobChange, RequestStats, StatsSink
from appliance.telemetry import rollup, store
from appliance.telemetry.models import (
    Iteration,
    KnobChangeRow,
    Request,
    TelemetryDrop,
    iteration_rollups,
)

log = logging.getLogger("appliance.telemetry")

_INSERT_CHUNK = 5000  # rows per executemany inside one batch transaction
PRUNE_CHUNK = 50_000  # rows per table deleted in one pruning transaction
_ITERATION_FIELDS = tuple(f.name for f in fields(IterationStats))
_ITERATION_COLUMNS = ("replica_id", *_ITERATION_FIELDS)
_iteration_values = operator.attrgetter(*_ITERATION_FIELDS)
_STARTED_AT = _ITERATION_COLUMNS.index("started_at")
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


class _StoreReplaced(Exception):
    """The SQLite file changed under the batch just committed; write it again to the new one."""


class _SchemaMismatch(Exception):
    """The store lacks tables or columns the models write (store.missing_columns): the models
    and the migrations disagree. A bug, not an outage: waiting cannot fix it."""


# What the buffer holds: IterationStats as a tuple of its field values (see on_iteration).
Record = tuple[Any, ...] | RequestStats | KnobChange


class TelemetryWriter(StatsSink):
    """Persists engine records to the telemetry store from a background thread.

    `capacity` bounds the records waiting in the buffer; while a write is failing the thread
    also holds the failed batch (trimmed to `capacity`, oldest dropped first).
    """

    def __init__(
        self,
        url: str = store.DEFAULT_URL,
        replica_id: str = "default",
        *,
        capacity: int = 100_000,
        flush_interval_s: float = 0.25,
        retention: Retention | str | None = None,
        prune_interval_s: float = 60.0,
        max_backoff_s: float = 5.0,
        log_interval_s: float = 30.0,
        busy_timeout_ms: int = 1000,
        sqlite_pragmas: Mapping[str, int | str] | None = None,
    ) -> None:
        if not replica_id or len(replica_id) > 64:
            raise ValueError(f"replica_id must be 1-64 characters, got {replica_id!r}")
        for name, value in (
            ("capacity", capacity),
            ("flush_interval_s", flush_interval_s),
            ("prune_interval_s", prune_interval_s),
            ("max_backoff_s", max_backoff_s),
            ("log_interval_s", log_interval_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        self._url = url
        self._safe_url = make_url(url).render_as_string(hide_password=True)
        self._sqlite_path = _sqlite_file(url)
        self.replica_id = replica_id
        self._capacity = int(capacity)
        self._flush_interval = float(flush_interval_s)
        if isinstance(retention, str):
            retention = parse_retention(retention)
        self._retention = retention or Retention()
        self._prune_interval = float(prune_interval_s)
        self._max_backoff = float(max_backoff_s)
        self._log_interval = float(log_interval_s)
        self._busy_timeout_ms = int(busy_timeout_ms)
        self._sqlite_pragmas = dict(sqlite_pragmas or {})
        self._head = store.head()
        self._known_revisions = set(store.revisions())

        # Shared with the engine's threads (guarded by _lock, never held across I/O).
        self._lock = threading.Lock()
        self._buf: deque[Record] = deque()
        self._appended = 0
        self._dropped = 0
        self._closed = False
        # Written by the writer thread only.
        self._written = 0
        self._drops_persisted = 0
        self._healthy = True
        self._hurry = False
        self._progress = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._close_deadline = math.inf
        self._lost_at_close = 0
        self._thread: threading.Thread | None = None
        self._engine: Engine | None = None
        self._file_id: tuple[int, int] | None = None
        self._schema_ok = False
        self._mismatch_reported = False
        self._backoff = 0.0
        self._retry_at = 0.0
        self._failures_unreported = 0
        self._last_report = -math.inf

    # -- the engine side: never waits ------------------------------------------------------

    def on_iteration(self, stats: IterationStats) -> None:
        # Buffered as a plain tuple of its fields: tuples of numbers and strings drop out of
        # the garbage collector's tracking, so a full buffer does not lengthen GC pauses.
        self._put(_iteration_values(stats))

    def on_request(self, stats: RequestStats) -> None:
        self._put(stats)

    def on_knob_change(self, change: KnobChange) -> None:
        self._put(change)

    def _put(self, record: Record) -> None:
        with self._lock:
            self._appended += 1
            if self._closed:
                self._dropped += 1
                return
            if len(self._buf) >= self._capacity:
                self._buf.popleft()
                self._dropped += 1
            self._buf.append(record)

    # -- control ---------------------------------------------------------------------------

    @property
    def rows_written(self) -> int:
        """Records committed to the store so far."""
        return self._written

    @property
    def rows_dropped(self) -> int:
        """Records lost so far (buffer overflow, rejected by the store, a store whose schema
        does not match the models, or still unwritten at close)."""
        with self._lock:
            return self._dropped

    @property
    def healthy(self) -> bool:
        """The thread runs and its last write attempt succeeded."""
        return self._thread is not None and self._thread.is_alive() and self._healthy

    def start(self) -> TelemetryWriter:
        if self._thread is not None:
            raise RuntimeError("TelemetryWriter already started")
        self._thread = threading.Thread(
            target=self._run, name=f"telemetry-writer-{self.replica_id}", daemon=True
        )
        self._thread.start()
        return self

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every record handed over before this call is written (or dropped)."""
        with self._lock:
            target = self._appended
        self._hurry = True
        self._wake.set()
        deadline = time.monotonic() + timeout
        with self._progress:
            while self._written + self.rows_dropped < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._progress.wait(min(remaining, 0.05))
        return True

    def close(self, timeout: float = 5.0) -> bool:
        """Write what can be written within `timeout`, then stop. Records still unwritten are
        counted as dropped. Returns True when nothing was left unwritten."""
        if self._thread is None:
            self.start()
        assert self._thread is not None
        self._close_deadline = time.monotonic() + timeout
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout + 1.0)
        with self._lock:
            self._closed = True
        return not self._thread.is_alive() and self._lost_at_close == 0

    def __enter__(self) -> TelemetryWriter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the writer thread -----------------------------------------------------------------

    def _run(self) -> None:
        held: deque[Record] = deque()  # taken from the buffer, not yet committed
        next_write = 0.0
        next_prune = 0.0 if self._retention.enabled else math.inf
        try:
            while True:
                stopping = self._stop.is_set()
                now = time.monotonic()
                if stopping and (now >= self._close_deadline or (not held and not self._pending())):
                    break
                due = max(self._retry_at, now if (self._hurry or stopping) else next_write)
                wake_at = min(due, next_prune, self._close_deadline)
                if wake_at > now:
                    self._wake.wait(wake_at - now)
                    self._wake.clear()
                    continue
                if now >= next_prune:
                    more = self._prune_safely()
                    next_prune = time.monotonic() + (self._flush_interval if more else self._prune_interval)
                if now >= due:
                    self._hurry = False
                    held = self._write_round(held)
                    next_write = time.monotonic() + self._flush_interval
        finally:
            with self._lock:
                self._closed = True
                lost = len(held) + len(self._buf)
                self._buf.clear()
                self._dropped += lost
                self._lost_at_close = lost
            if lost:
                log.warning("telemetry writer closed with %d rows unwritten (dropped)", lost)
            self._dispose()
            with self._progress:
                self._progress.notify_all()

    def _pending(self) -> bool:
        with self._lock:
            return bool(self._buf) or self._dropped > self._drops_persisted

    def _write_round(self, held: deque[Record]) -> deque[Record]:
        """One transaction: everything held plus everything buffered. Returns what is still
        unwritten (empty on success)."""
        with self._lock:
            fresh, self._buf = self._buf, deque()
            dropped = self._dropped
        held.extend(fresh)
        excess = len(held) - self._capacity
        if excess > 0:
            for _ in range(excess):
                held.popleft()
            with self._lock:
                self._dropped += excess
                dropped = self._dropped
        new_drops = dropped - self._drops_persisted
        if not held and not new_drops:
            return held
        try:
            engine = self._open()
            with engine.begin() as conn:
                self._insert(conn, held, new_drops)
            if self._sqlite_path and self._stat() != self._file_id:
                raise _StoreReplaced()
        except _StoreReplaced:
            self._hurry = True  # the next round recreates the file and writes the batch again
            return held
        except _SchemaMismatch as exc:
            self._drop_mismatched(held, exc)
            return deque()
        except Exception as exc:  # noqa: BLE001 - any store failure must not stop serving
            if _is_bad_data(exc):
                return self._salvage(held, exc)
            self._failed(exc)
            return held
        self._drops_persisted += new_drops
        self._succeeded()
        self._count_written(len(held))
        return deque()

    def _salvage(self, held: deque[Record], first_error: Exception) -> deque[Record]:
        """A batch the store rejected as bad data: write its records one by one, dropping
        (and counting) those the store rejects, so one bad record cannot block the rest."""
        log.warning(
            "telemetry store %s rejected a batch (%s); writing it record by record",
            self._safe_url,
            str(first_error).splitlines()[0],
        )
        rejected = 0
        while held:
            try:
                with self._open().begin() as conn:
                    self._insert(conn, (held[0],), 0)
            except Exception as exc:  # noqa: BLE001
                if not _is_bad_data(exc):
                    self._failed(exc)
                    break
                rejected += 1
            else:
                self._succeeded()
                self._count_written(1)
            held.popleft()
        if rejected:
            log.warning("telemetry writer dropped %d records the store rejected", rejected)
            with self._lock:
                self._dropped += rejected
        return held

    def _drop_mismatched(self, held: deque[Record], exc: _SchemaMismatch) -> None:
        """Drop (and count) a batch the store's schema cannot take; say so loudly, once. The
        schema is checked again every round, so writing resumes once the store is migrated."""
        if not self._mismatch_reported:
            log.error(
                "telemetry store %s lacks %s, which the models write: the models and the "
                "migrations disagree (a bug: add the migration). Telemetry is dropped until the "
                "store matches.",
                self._safe_url,
                exc,
            )
            self._mismatch_reported = True
        self._healthy = False
        with self._lock:
            self._dropped += len(held)
        with self._progress:
            self._progress.notify_all()

    def _count_written(self, n: int) -> None:
        with self._progress:
            self._written += n
            self._progress.notify_all()

    def _insert(self, conn: Connection, records: Iterable[Record], new_drops: int) -> None:
        rid = self.replica_id
        iterations: list[tuple[Any, ...]] = []
        requests: list[dict[str, Any]] = []
        knob_changes: list[dict[str, Any]] = []
        for record in records:
            if type(record) is tuple:
                iterations.append((rid, *record))
            else:
                row = dict(record.__dict__)
                row["replica_id"] = rid
                (requests if isinstance(record, RequestStats) else knob_changes).append(row)
        _insert_iterations(conn, iterations)
        for table, rows in ((Request.__table__, requests), (KnobChangeRow.__table__, knob_changes)):
            if rows:
                conn.execute(insert(table), rows)
        for lo, hi in rollup.second_ranges(row[_STARTED_AT] for row in iterations):
            rollup.rebuild(conn, lo, hi, rid)
        if new_drops:
            conn.execute(
                insert(TelemetryDrop.__table__),
                {"replica_id": rid, "at": time.time(), "count": new_drops},
            )

    def _prune_safely(self) -> bool:
        """One pruning transaction; True when more is left to prune."""
        try:
            engine = self._open()
            with engine.begin() as conn:
                return prune(conn, self._retention, self.replica_id)
        except _SchemaMismatch:  # reported by the write rounds
            return False
        except Exception as exc:  # noqa: BLE001 - retried at the next prune interval
            self._failed(exc)
            return False

    # -- opening, failure handling ---------------------------------------------------------

    def _open(self) -> Engine:
        """The engine to write with; (re)creates the store when needed."""
        if self._file_id is not None and self._stat() != self._file_id:
            log.warning("telemetry store %s was deleted or replaced; recreating it", self._safe_url)
            self._dispose()  # closing the old connections first lets SQLite tidy its -wal/-shm
            self._file_id = None
        if self._engine is None:
            self._engine = store.make_engine(
                self._url, busy_timeout_ms=self._busy_timeout_ms, sqlite_pragmas=self._sqlite_pragmas
            )
            self._schema_ok = False
        if not self._schema_ok:
            revision = store.current(self._engine)
            if revision is None or (revision != self._head and revision in self._known_revisions):
                log.info("telemetry store %s at revision %s; upgrading", self._safe_url, revision)
                store.upgrade(self._engine)
            missing = store.missing_columns(self._engine)
            if missing:
                raise _SchemaMismatch(", ".join(missing))
            self._schema_ok = True
            self._mismatch_reported = False
            if self._sqlite_path:
                self._file_id = self._stat()
        return self._engine

    def _stat(self) -> tuple[int, int] | None:
        assert self._sqlite_path is not None
        try:
            st = os.stat(self._sqlite_path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)

    def _dispose(self) -> None:
        if self._engine is not None:
            try:
                self._engine.dispose()
            except Exception:  # noqa: BLE001 - closing a broken connection may fail too
                log.debug("disposing the telemetry engine failed", exc_info=True)
        self._engine = None
        self._schema_ok = False

    def _failed(self, exc: Exception) -> None:
        self._healthy = False
        self._dispose()  # fresh connections (and a schema check) on the next attempt
        self._backoff = min(self._max_backoff, max(self._flush_interval, self._backoff * 2))
        self._retry_at = time.monotonic() + self._backoff
        self._failures_unreported += 1
        now = time.monotonic()
        if now - self._last_report >= self._log_interval:
            log.warning(
                "telemetry store %s not writable (%d failed attempts since last report, "
                "%d rows dropped in all, next attempt in %.1fs): %s: %s",
                self._safe_url,
                self._failures_unreported,
                self.rows_dropped,
                self._backoff,
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            self._last_report = now
            self._failures_unreported = 0

    def _succeeded(self) -> None:
        if not self._healthy:
            log.warning(
                "telemetry store %s writable again (%d rows dropped in all)",
                self._safe_url,
                self.rows_dropped,
            )
        self._healthy = True
        self._backoff = 0.0
        self._retry_at = 0.0
        self._failures_unreported = 0
        self._last_report = -math.inf


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


def _is_bad_data(exc: Exception) -> bool:
    """Errors caused by the records themselves (retrying the same batch cannot help): the
    store's constraint and data errors, and a record of the wrong shape or type."""
    if isinstance(exc, (IntegrityError, DataError, TypeError, ValueError, AttributeError)):
        return True
    return isinstance(exc, StatementError) and not isinstance(exc, DBAPIError)


def _sqlite_file(url: str) -> str | None:
    """The absolute path of a file-backed SQLite URL (plain or `file:` URI form), else None."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        return None
    database = parsed.database
    if database.startswith("file:"):
        database = database[len("file:") :].split("?", 1)[0]
        if database.startswith("//"):
            database = database[2:]
    if database in ("", ":memory:") or parsed.query.get("mode") == "memory":
        return None
    return os.path.abspath(database)
