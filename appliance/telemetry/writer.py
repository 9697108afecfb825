"""TelemetryWriter: the engine's stats sink that persists records off the hot path.

The engine calls on_iteration / on_request / on_knob_change inline; each only appends the
record to a bounded in-memory buffer (buffer.RecordBuffer) under a lock that is never held
across I/O. A writer thread takes everything buffered once per `flush_interval_s` and inserts
it in one transaction (batch.insert_batch, with the per-second rollup of the new iteration
rows), prunes old rows per the retention policy (retention.prune), and survives a store that
is locked, read-only, deleted or full: it retries with backoff, logs once per `log_interval_s`
(health.StoreHealth), drops the oldest rows when the buffer overflows (counted in
`rows_dropped` and, once the store works again, in the telemetry_drops table) and resumes by
itself. A SQLite file that is deleted or replaced while open is detected (by inode) and
recreated at the head revision, and a store that lacks columns the models write (the models
and the migrations disagree: a bug, not an outage) is reported once as an error
(store_handle.StoreHandle); its records are dropped and counted at once instead of being held
and retried.

Ownership of TelemetryWriter's attributes:
- shared with the engine's threads: `_buffer` alone (its own lock);
- the writer thread's: `_store`, `_health`, `_drops_persisted`, `_lost_at_close`, and
  `_written` (changed under `_progress`, which flush() waits on);
- the controlling thread's (start/flush/close): `_thread` and `_close_deadline`, set before
  the thread starts or before `_stop` is set; `_hurry` is set by flush() and cleared by the
  writer thread (a lost wake-up costs at most one flush interval);
- fixed at construction: the settings.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Mapping

from appliance.engine.stats import IterationStats, KnobChange, RequestStats, StatsSink
from appliance.telemetry import store
from appliance.telemetry.batch import Record, insert_batch, is_bad_data, iteration_record
from appliance.telemetry.buffer import RecordBuffer
from appliance.telemetry.health import StoreHealth
from appliance.telemetry.retention import Retention, parse_retention, prune
from appliance.telemetry.store_handle import SchemaMismatch, StoreHandle, StoreReplaced

log = logging.getLogger("appliance.telemetry")


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
        self._store = StoreHandle(url, busy_timeout_ms=int(busy_timeout_ms), sqlite_pragmas=sqlite_pragmas or {})
        if isinstance(retention, str):
            retention = parse_retention(retention)
        self.replica_id = replica_id
        self._capacity = int(capacity)
        self._flush_interval = float(flush_interval_s)
        self._retention = retention or Retention()
        self._prune_interval = float(prune_interval_s)
        self._buffer = RecordBuffer(self._capacity)
        self._health = StoreHealth(
            self._store.safe_url,
            min_backoff_s=self._flush_interval,
            max_backoff_s=float(max_backoff_s),
            log_interval_s=float(log_interval_s),
        )
        self._written = 0
        self._drops_persisted = 0
        self._lost_at_close = 0
        self._progress = threading.Condition()
        self._hurry = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._close_deadline = math.inf
        self._thread: threading.Thread | None = None

    # -- the engine side: never waits ------------------------------------------------------

    def on_iteration(self, stats: IterationStats) -> None:
        self._buffer.put(iteration_record(stats))

    def on_request(self, stats: RequestStats) -> None:
        self._buffer.put(stats)

    def on_knob_change(self, change: KnobChange) -> None:
        self._buffer.put(change)

    # -- control ---------------------------------------------------------------------------

    @property
    def rows_written(self) -> int:
        """Records committed to the store so far."""
        return self._written

    @property
    def rows_dropped(self) -> int:
        """Records lost so far (buffer overflow, rejected by the store, a store whose schema
        does not match the models, or still unwritten at close)."""
        return self._buffer.dropped

    @property
    def healthy(self) -> bool:
        """The thread runs and its last write attempt succeeded."""
        return self._thread is not None and self._thread.is_alive() and self._health.healthy

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
        target = self._buffer.appended
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
        self._buffer.close()
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
                due = max(self._health.retry_at, now if (self._hurry or stopping) else next_write)
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
            self._buffer.close()
            lost = self._lost_at_close = self._buffer.discard(len(held))
            if lost:
                log.warning("telemetry writer closed with %d rows unwritten (dropped)", lost)
            self._store.dispose()
            with self._progress:
                self._progress.notify_all()

    def _pending(self) -> bool:
        return self._buffer.waiting() or self._buffer.dropped > self._drops_persisted

    def _write_round(self, held: deque[Record]) -> deque[Record]:
        """One transaction: everything held plus everything buffered. Returns what is still
        unwritten (empty on success)."""
        fresh, dropped = self._buffer.take()
        held.extend(fresh)
        excess = len(held) - self._capacity
        if excess > 0:
            for _ in range(excess):
                held.popleft()
            dropped = self._buffer.count_dropped(excess)
        new_drops = dropped - self._drops_persisted
        if not held and not new_drops:
            return held
        try:
            with self._store.open().begin() as conn:
                insert_batch(conn, held, self.replica_id, new_drops)
            self._store.check_not_replaced()
        except StoreReplaced:
            self._hurry = True  # the next round recreates the file and writes the batch again
            return held
        except SchemaMismatch:
            self._drop_mismatched(held)
            return deque()
        except Exception as exc:  # noqa: BLE001 - any store failure must not stop serving
            if is_bad_data(exc):
                return self._salvage(held, exc)
            self._failed(exc)
            return held
        self._drops_persisted += new_drops
        self._health.succeeded(self.rows_dropped)
        self._count_written(len(held))
        return deque()

    def _salvage(self, held: deque[Record], first_error: Exception) -> deque[Record]:
        """A batch the store rejected as bad data: write its records one by one, dropping
        (and counting) those the store rejects, so one bad record cannot block the rest."""
        log.warning(
            "telemetry store %s rejected a batch (%s); writing it record by record",
            self._store.safe_url,
            str(first_error).splitlines()[0],
        )
        rejected = 0
        while held:
            try:
                with self._store.open().begin() as conn:
                    insert_batch(conn, (held[0],), self.replica_id, 0)
            except Exception as exc:  # noqa: BLE001
                if not is_bad_data(exc):
                    self._failed(exc)
                    break
                rejected += 1
            else:
                self._health.succeeded(self.rows_dropped)
                self._count_written(1)
            held.popleft()
        if rejected:
            log.warning("telemetry writer dropped %d records the store rejected", rejected)
            self._buffer.count_dropped(rejected)
        return held

    def _drop_mismatched(self, held: deque[Record]) -> None:
        """Drop (and count) a batch the store's schema cannot take (StoreHandle reported it).
        The schema is checked again every round, so writing resumes once the store is migrated."""
        self._health.mismatched()
        self._buffer.count_dropped(len(held))
        with self._progress:
            self._progress.notify_all()

    def _count_written(self, n: int) -> None:
        with self._progress:
            self._written += n
            self._progress.notify_all()

    def _prune_safely(self) -> bool:
        """One pruning transaction; True when more is left to prune."""
        try:
            with self._store.open().begin() as conn:
                return prune(conn, self._retention, self.replica_id)
        except SchemaMismatch:  # reported by the StoreHandle; the write rounds drop the records
            return False
        except Exception as exc:  # noqa: BLE001 - retried at the next prune interval
            self._failed(exc)
            return False

    def _failed(self, exc: Exception) -> None:
        self._store.dispose()  # fresh connections (and a schema check) on the next attempt
        self._health.failed(exc, self.rows_dropped)
