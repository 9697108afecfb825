"""TelemetryWriter against real SQLite files: batching, overflow, retention, and a store that
is locked, read-only, deleted or full while the engine keeps calling the sink."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from appliance.engine.stats import IterationStats, KnobChange, RequestStats
from appliance.telemetry import store
from appliance.telemetry.writer import Retention, TelemetryWriter, parse_retention, prune

from records_factory import iteration

# A sink call that waited for a locked store would take at least the busy timeout (1 s in
# these tests); the bound leaves room for a loaded 2-core machine.
MAX_SINK_CALL_S = 0.25


def _iteration(i: int, t: float, running: int = 4) -> IterationStats:
    return iteration(iteration=i, started_at=t, duration_s=0.002, running=running, waiting=1, prefill_seqs=1,
                     prefill_tokens=32, decode_seqs=running - 1, decode_tokens=running - 1,
                     scheduled_tokens=31 + running, token_budget=512, max_num_seqs=64, kv_blocks_used=10,
                     kv_blocks_free=90, kv_blocks_total=100, knob_version=1, decode_context_tokens=0)


def _db(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 5000")
    return conn


def _iteration_numbers(path: Path) -> list[int]:
    with _db(path) as conn:
        return [r[0] for r in conn.execute("SELECT iteration FROM iterations ORDER BY iteration")]


def _persisted_drops(path: Path) -> int:
    with _db(path) as conn:
        return conn.execute("SELECT coalesce(sum(count), 0) FROM telemetry_drops").fetchone()[0]


def _wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


class Pump:
    """Plays the engine: feeds iterations and records the slowest sink call."""

    def __init__(self, writer: TelemetryWriter) -> None:
        self.writer = writer
        self.pushed = 0
        self.slowest = 0.0
        self.t0 = time.time()

    def push(self, n: int, pause_s: float = 0.0) -> None:
        # The collector is paused while timing: a GC pass (long in a process that imported
        # torch) is not the sink waiting on the store, which is what is measured here.
        gc.disable()
        try:
            for _ in range(n):
                record = _iteration(self.pushed, self.t0 + self.pushed * 0.001)
                start = time.perf_counter()
                self.writer.on_iteration(record)
                self.slowest = max(self.slowest, time.perf_counter() - start)
                self.pushed += 1
                if pause_s:
                    time.sleep(pause_s)
        finally:
            gc.enable()


@pytest.fixture()
def sql_threads() -> Iterator[list[str]]:
    """Names of the threads that run each SQL statement (through SQLAlchemy) during a test."""
    names: list[str] = []

    def record(*_args: object) -> None:
        names.append(threading.current_thread().name)

    event.listen(Engine, "before_cursor_execute", record)
    yield names
    event.remove(Engine, "before_cursor_execute", record)


@pytest.fixture()
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "appliance.db"


def _writer(path: Path, **kwargs: object) -> TelemetryWriter:
    options: dict[str, object] = dict(
        capacity=500, flush_interval_s=0.05, max_backoff_s=0.2, busy_timeout_ms=1000, log_interval_s=60
    )
    options.update(kwargs)
    return TelemetryWriter(f"sqlite:///{path}", "test", **options)  # type: ignore[arg-type]


def test_rows_land_in_batches_one_transaction_each(db_path: Path) -> None:
    """Every row lands exactly once, in batches: never more rows in one transaction than the
    buffer holds, and a burst or a trickle takes a handful of transactions, not one per row.
    The split of a batch between rounds depends on thread timing, so no split is asserted."""
    events: list[tuple[str, float]] = []
    writer = TelemetryWriter(f"sqlite:///{db_path}", "test")  # default 250 ms interval

    def in_writer() -> bool:  # this writer's thread only (another test's may still be closing)
        return threading.current_thread() is writer._thread

    def on_execute(conn, cursor, statement, parameters, context, executemany):  # noqa: ANN001
        if in_writer() and statement.startswith("INSERT INTO iterations"):
            events.append(("rows", len(parameters) if executemany else 1))

    def on_commit(conn) -> None:  # noqa: ANN001
        if in_writer():
            events.append(("commit", time.monotonic()))

    event.listen(Engine, "after_cursor_execute", on_execute)
    event.listen(Engine, "commit", on_commit)
    try:
        pump = Pump(writer)
        pump.push(7000)  # before start: one burst
        writer.start()
        assert writer.flush(10)
        burst = _transactions(events)
        assert sum(rows for rows, _ in burst) == 7000
        assert all(rows <= writer._capacity for rows, _ in burst), burst
        assert len(burst) <= 2, burst  # one round takes the whole buffer (+ flush()'s round)
        events.clear()
        began = time.monotonic()
        pump.push(1200, pause_s=0.001)  # a steady trickle for over a second
        assert writer.flush(10)
        elapsed = time.monotonic() - began
        trickle = _transactions(events)
        assert sum(rows for rows, _ in trickle) == 1200
        # Batches, not rows: at most one transaction per 250 ms (+ the one flush() asks for).
        assert 2 <= len(trickle) <= elapsed / 0.25 + 2, (elapsed, trickle)
        gaps = [b - a for (_, a), (_, b) in zip(trickle, trickle[1:], strict=False)]
        assert all(gap >= 0.2 for gap in gaps[:-1]), gaps  # the last one may be flush()'s
        assert writer.close()
    finally:
        event.remove(Engine, "after_cursor_execute", on_execute)
        event.remove(Engine, "commit", on_commit)
    assert _iteration_numbers(db_path) == list(range(8200))
    assert writer.rows_written == 8200 and writer.rows_dropped == 0


def _transactions(events: list[tuple[str, float]]) -> list[tuple[int, float]]:
    """(iteration rows, commit time) of each committed writer transaction that held rows."""
    result, rows = [], 0
    for kind, value in events:
        if kind == "rows":
            rows += int(value)
        else:
            if rows:
                result.append((rows, value))
            rows = 0
    return result


def test_requests_and_knob_changes_are_written(db_path: Path) -> None:
    t = time.time()
    with _writer(db_path) as writer:
        writer.on_request(
            RequestStats("cmpl-1", "loadtest", "run-1", t, t + 0.1, t + 0.2, t + 1.0, 12, 30, "length", 1, 0)
        )
        writer.on_knob_change(KnobChange(3, 41, t, {"max_num_seqs": 64}, {"max_num_seqs": 8}, "api"))
        assert writer.flush(10)
    with _db(db_path) as conn:
        assert conn.execute(
            "SELECT request_id, replica_id, run_id, source, output_tokens, finish_reason, preemptions FROM requests"
        ).fetchall() == [("cmpl-1", "test", "run-1", "loadtest", 30, "length", 1)]
        assert conn.execute(
            "SELECT replica_id, version, iteration, old, new, source FROM knob_changes"
        ).fetchall() == [("test", 3, 41, '{"max_num_seqs": 64}', '{"max_num_seqs": 8}', "api")]


def test_buffer_overflow_drops_the_oldest_and_counts_them(db_path: Path) -> None:
    writer = _writer(db_path, capacity=10)
    pump = Pump(writer)
    pump.push(25)
    assert writer.rows_dropped == 15
    writer.start()
    assert writer.flush(10)
    assert writer.close()
    assert _iteration_numbers(db_path) == list(range(15, 25))
    assert writer.rows_written == 10 and writer.rows_dropped == 15
    assert _persisted_drops(db_path) == 15


def test_records_the_store_rejects_are_dropped_not_retried_forever(db_path: Path) -> None:
    t = time.time()
    with _writer(db_path) as writer:
        Pump(writer).push(10)
        # NULL in a NOT NULL column, a timestamp that is not a number, not a record at all.
        writer.on_request(RequestStats("bad", "api", None, t, None, None, t, 1, 1, None, 0, 0))  # type: ignore[arg-type]
        writer.on_iteration(_iteration(99, None))  # type: ignore[arg-type]
        writer.on_knob_change(object())  # type: ignore[arg-type]
        assert writer.flush(10)
        assert writer.healthy
        assert writer.rows_written == 10 and writer.rows_dropped == 3
        Pump(writer).push(5)
        assert writer.flush(10)
    assert len(_iteration_numbers(db_path)) == 15
    assert _persisted_drops(db_path) == 3


def test_a_store_lacking_a_model_column_is_reported_once_as_a_bug_not_an_outage(
    db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # What a metric added to the models without its migration looks like to the writer.
    store.upgrade(f"sqlite:///{db_path}")
    with _db(db_path) as conn:
        conn.execute("ALTER TABLE iterations DROP COLUMN padding_tokens")
    with caplog.at_level(logging.WARNING, logger="appliance.telemetry"):
        writer = _writer(db_path).start()
        pump = Pump(writer)
        for _ in range(3):  # several write rounds, each dropping its records at once
            pump.push(20)
            assert writer.flush(10)
        assert writer.rows_written == 0 and writer.rows_dropped == 60
        assert not writer.healthy
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "iterations.padding_tokens" in errors[0], errors
        assert not [r for r in caplog.records if "not writable" in r.getMessage()]  # no outage
        with _db(db_path) as conn:  # the store migrated to match: writing resumes
            conn.execute("ALTER TABLE iterations ADD COLUMN padding_tokens INTEGER NOT NULL DEFAULT 0")
        pump.push(5)
        assert writer.flush(10)
        assert writer.healthy and writer.rows_written == 5
    assert writer.close()
    assert _iteration_numbers(db_path) == list(range(60, 65))
    assert _persisted_drops(db_path) == 60


def _run_fault(
    db_path: Path,
    caplog: pytest.LogCaptureFixture,
    sql_threads: list[str],
    break_store: Callable[[], None],
    repair_store: Callable[[], None],
    **writer_options: object,
) -> tuple[TelemetryWriter, Pump, int]:
    """Write, break the store, keep feeding until the writer reports trouble and drops rows,
    repair, feed more. Returns the writer (closed), the pump and the first index fed after
    the repair."""
    writer = _writer(db_path, **writer_options).start()
    pump = Pump(writer)
    pump.push(200)
    assert writer.flush(10)
    with caplog.at_level(logging.WARNING, logger="appliance.telemetry"):
        break_store()
        sql_threads.clear()
        deadline = time.monotonic() + 20
        while (writer.healthy or writer.rows_dropped == 0) and time.monotonic() < deadline:
            pump.push(100, pause_s=0.0005)
        assert not writer.healthy and writer.rows_dropped > 0, "the fault never showed"
        pump.push(300, pause_s=0.001)  # keep serving through several failed attempts
        failing = [r for r in caplog.records if "not writable" in r.getMessage()]
        assert len(failing) == 1, [r.getMessage() for r in failing]  # once per interval
        repair_store()
        after_repair = pump.pushed
        pump.push(200)
        assert writer.flush(20), "writing did not resume after the repair"
        assert writer.healthy
        assert any("writable again" in r.getMessage() for r in caplog.records)
    assert writer.close()
    assert sql_threads and set(sql_threads) == {writer_thread_name(writer)}  # never the caller
    assert pump.slowest < MAX_SINK_CALL_S, f"a sink call took {pump.slowest:.3f}s"
    assert writer.rows_written + writer.rows_dropped == pump.pushed
    assert _persisted_drops(db_path) == writer.rows_dropped
    with _db(db_path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    return writer, pump, after_repair


def writer_thread_name(writer: TelemetryWriter) -> str:
    return f"telemetry-writer-{writer.replica_id}"


def test_store_locked_by_another_writer(
    db_path: Path, caplog: pytest.LogCaptureFixture, sql_threads: list[str]
) -> None:
    holder = _db(db_path)

    def lock() -> None:
        holder.execute("BEGIN EXCLUSIVE")

    def unlock() -> None:
        holder.execute("COMMIT")
        holder.close()

    writer, pump, after = _run_fault(db_path, caplog, sql_threads, lock, unlock)
    numbers = _iteration_numbers(db_path)
    assert numbers[:200] == list(range(200))  # written before the lock
    assert set(range(after, pump.pushed)) <= set(numbers)
    assert len(numbers) == writer.rows_written


def _chattr_works(tmp_path: Path) -> str | None:
    probe = tmp_path / "chattr-probe"
    probe.write_text("x")
    if shutil.which("chattr") is None:
        return "chattr is not installed"
    result = subprocess.run(["chattr", "+i", str(probe)], capture_output=True, text=True)
    if result.returncode != 0:
        return f"cannot set the immutable attribute here: {result.stderr.strip()}"
    subprocess.run(["chattr", "-i", str(probe)], check=True)
    return None


def test_store_made_read_only(
    db_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, sql_threads: list[str]
) -> None:
    # We run as root, which ignores permission bits; the immutable attribute binds root too.
    # The -shm file stays writable: SQLite maps it into memory and a failed write there is a
    # SIGBUS, not an error.
    reason = _chattr_works(tmp_path)
    if reason:
        pytest.skip(reason)
    files = [str(db_path), f"{db_path}-wal"]
    try:
        writer, pump, after = _run_fault(
            db_path,
            caplog,
            sql_threads,
            lambda: subprocess.run(["chattr", "+i", *files], check=True),
            lambda: subprocess.run(["chattr", "-i", *files], check=True),
        )
    finally:
        subprocess.run(["chattr", "-i", *[f for f in files if os.path.exists(f)]])
    numbers = _iteration_numbers(db_path)
    assert set(range(after, pump.pushed)) <= set(numbers)
    assert len(numbers) == writer.rows_written


def test_store_file_deleted_while_open_is_recreated(db_path: Path, sql_threads: list[str]) -> None:
    writer = _writer(db_path).start()
    pump = Pump(writer)
    pump.push(300)
    assert writer.flush(10)
    os.unlink(db_path)  # the way `rm appliance.db` does it: -wal and -shm stay behind
    sql_threads.clear()
    deleted_at = pump.pushed
    pump.push(500, pause_s=0.001)
    assert writer.flush(10)
    assert writer.close()
    assert set(sql_threads) == {writer_thread_name(writer)}
    assert pump.slowest < MAX_SINK_CALL_S
    # (Inode numbers are no evidence here: once the writer let go of the old file, the
    # filesystem may hand its number to the new one.)
    assert store.current(f"sqlite:///{db_path}") == store.head()
    # Everything fed after the deletion is in the new file, none of it went to the old inode.
    assert _iteration_numbers(db_path) == list(range(deleted_at, pump.pushed))
    with _db(db_path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_store_deleted_and_path_blocked_until_repaired(
    db_path: Path, caplog: pytest.LogCaptureFixture, sql_threads: list[str]
) -> None:
    def delete_and_block() -> None:
        os.unlink(db_path)
        os.mkdir(db_path)  # a directory where the file was: SQLite cannot recreate it

    writer, pump, after = _run_fault(
        db_path, caplog, sql_threads, delete_and_block, lambda: os.rmdir(db_path)
    )
    assert store.current(f"sqlite:///{db_path}") == store.head()
    numbers = _iteration_numbers(db_path)
    assert set(range(after, pump.pushed)) <= set(numbers)
    assert min(numbers) >= 200  # the first file's rows went with it


def test_store_full(db_path: Path, caplog: pytest.LogCaptureFixture, sql_threads: list[str]) -> None:
    # A size-limited store: SQLite refuses to grow the file past max_page_count pages.
    def fill() -> None:
        pass  # the writer fills it by itself as the pump keeps feeding

    def free_space() -> None:
        with _db(db_path) as conn:  # an operator deleting old rows
            conn.execute("DELETE FROM iterations")
            conn.execute("DELETE FROM iteration_rollups")

    writer, pump, after = _run_fault(
        db_path, caplog, sql_threads, fill, free_space, sqlite_pragmas={"max_page_count": 120}
    )
    numbers = set(_iteration_numbers(db_path))
    assert set(range(after, pump.pushed)) <= numbers


def test_close_on_a_store_that_stays_broken_returns_in_time_and_counts_the_loss(db_path: Path) -> None:
    writer = _writer(db_path).start()
    pump = Pump(writer)
    pump.push(10)
    assert writer.flush(10)
    holder = _db(db_path)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        pump.push(50)
        start = time.monotonic()
        assert writer.close(timeout=0.5) is False
        assert time.monotonic() - start < 3
        assert writer.rows_written == 10 and writer.rows_dropped == 50
        writer.on_iteration(_iteration(99, time.time()))  # after close: counted, not kept
        assert writer.rows_dropped == 51
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_parse_retention() -> None:
    assert parse_retention("7d") == Retention(max_age_s=7 * 86400)
    assert parse_retention("24h") == Retention(max_age_s=86400)
    assert parse_retention("90m") == Retention(max_age_s=5400)
    assert parse_retention("1.5h") == Retention(max_age_s=5400)
    assert parse_retention("1000000rows") == Retention(max_rows=1_000_000)
    assert parse_retention(" 7d , 1000000rows ") == Retention(max_age_s=7 * 86400, max_rows=1_000_000)
    assert parse_retention("none") == Retention() and not Retention().enabled
    for bad in ("7x", "d7", "7d,8d", "-1rows", "12", "7d;5rows"):
        with pytest.raises(ValueError) as info:
            parse_retention(bad)
        assert "invalid retention" in str(info.value)
    with pytest.raises(ValueError, match="'7x'"):
        parse_retention("24h,7x")
    with pytest.raises(ValueError, match="max_rows must be > 0"):
        parse_retention("0rows")


def _rollup_matches_raw(path: Path) -> None:
    with _db(path) as conn:
        raw = conn.execute(
            "SELECT replica_id, CAST(started_at AS INTEGER) s, count(*), max(running), sum(running)"
            " FROM iterations GROUP BY 1, 2 ORDER BY 1, 2"
        ).fetchall()
        rolled = conn.execute(
            "SELECT replica_id, second, n, CAST(running_max AS INTEGER), CAST(running_sum AS INTEGER)"
            " FROM iteration_rollups ORDER BY 1, 2"
        ).fetchall()
    assert raw == rolled


def test_retention_by_age_prunes_rows_and_rollups(db_path: Path) -> None:
    now = time.time()
    writer = _writer(db_path, capacity=10_000, retention="1h", prune_interval_s=0.2)
    for i in range(1000):  # 100 s of rows two hours ago, then 100 s of recent ones
        writer.on_iteration(_iteration(i, now - 7200 + i * 0.1))
    for i in range(1000, 2000):
        writer.on_iteration(_iteration(i, now - 300 + (i - 1000) * 0.1))
    old = RequestStats("old", "api", None, now - 7300, None, None, now - 7200, 1, 0, "abort", 0, 0)
    new = RequestStats("new", "api", None, now - 10, None, None, now - 5, 1, 0, "abort", 0, 0)
    writer.on_request(old)
    writer.on_request(new)
    writer.start()
    assert writer.flush(10)
    assert _wait_until(lambda: _iteration_numbers(db_path) == list(range(1000, 2000)), 10)
    assert writer.close()
    _rollup_matches_raw(db_path)
    with _db(db_path) as conn:
        assert conn.execute("SELECT request_id FROM requests").fetchall() == [("new",)]


def test_retention_by_rows_keeps_the_newest_of_its_own_replica(db_path: Path) -> None:
    url = f"sqlite:///{db_path}"
    now = time.time() - 1000
    with TelemetryWriter(url, "other", flush_interval_s=0.05) as other:
        for i in range(300):
            other.on_iteration(_iteration(i, now + i * 0.37))
        assert other.flush(10)
    writer = TelemetryWriter(url, "test", flush_interval_s=0.05, retention="100rows", prune_interval_s=0.2)
    for i in range(1000):
        writer.on_iteration(_iteration(i, now + i * 0.37))
    writer.start()
    assert writer.flush(10)

    def counts() -> dict[str, int]:
        with _db(db_path) as conn:
            return dict(conn.execute("SELECT replica_id, count(*) FROM iterations GROUP BY 1").fetchall())

    assert _wait_until(lambda: counts() == {"other": 300, "test": 100}, 10), counts()
    assert writer.close()
    with _db(db_path) as conn:
        kept = [
            r[0] for r in conn.execute("SELECT iteration FROM iterations WHERE replica_id='test' ORDER BY 1")
        ]
    assert kept == list(range(900, 1000))
    _rollup_matches_raw(db_path)


@pytest.fixture(autouse=True)
def _no_thread_left_behind() -> Iterator[None]:
    before = {t.name for t in threading.enumerate()}
    yield
    assert _wait_until(lambda: not ({t.name for t in threading.enumerate()} - before - {"MainThread"}), 5), (
        "a telemetry writer thread outlived its test"
    )


def test_pruning_a_backlog_goes_in_small_transactions(db_path: Path) -> None:
    url = f"sqlite:///{db_path}"
    now = time.time()
    with _writer(db_path, capacity=10_000) as writer:
        for i in range(3000):  # 3000 rows two hours old, 500 recent ones
            writer.on_iteration(_iteration(i, now - 7200 + i * 0.1))
        for i in range(3000, 3500):
            writer.on_iteration(_iteration(i, now - 60 + (i - 3000) * 0.1))
        assert writer.flush(10)
    engine = store.make_engine(url)
    steps = 0
    try:
        while True:
            with engine.begin() as conn:
                more = prune(conn, Retention(max_age_s=3600), "test", chunk=400)
            steps += 1
            _rollup_matches_raw(db_path)  # consistent after every transaction
            if not more:
                break
            assert steps < 20
    finally:
        engine.dispose()
    assert steps == 8  # 3000 old rows, 400 per transaction, then the rest
    assert _iteration_numbers(db_path) == list(range(3000, 3500))
