"""Alembic migrations of the telemetry store, on real SQLite files."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, inspect

from appliance.telemetry import store
from appliance.telemetry.models import Base

TABLES = {
    "iterations",
    "iteration_rollups",
    "requests",
    "knob_changes",
    "runs",
    "run_requests",
    "telemetry_drops",
    "step_time_models",
    "fleet_sizes",
}


@pytest.fixture()
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'appliance.db'}"


def _tables_and_indexes(url: str) -> tuple[set[str], set[str]]:
    engine = store.make_engine(url)
    try:
        insp = inspect(engine)
        tables = set(insp.get_table_names()) - {"alembic_version"}
        indexes = {ix["name"] for t in tables for ix in insp.get_indexes(t)}
        return tables, indexes
    finally:
        engine.dispose()


def test_revisions_are_linear_with_a_head() -> None:
    assert store.revisions() == ["0008_step_time_noise", "0007_fleet_sizes", "0006_knob_reasons", "0005_prefix_cache",
                                 "0004_binding_counters", "0003_step_time_models", "0002", "0001"]
    assert store.head() == "0008_step_time_noise"
    assert store.MIGRATIONS_DIR.name == "migrations" and (store.MIGRATIONS_DIR / "env.py").exists()


def test_upgrade_from_empty_creates_every_table(url: str) -> None:
    assert store.current(url) is None
    store.upgrade(url)
    assert store.current(url) == store.head()
    tables, indexes = _tables_and_indexes(url)
    assert tables == TABLES
    assert {"ix_iterations_replica_started", "ix_requests_run", "ix_runs_status"} <= indexes
    store.upgrade(url)  # idempotent
    assert store.current(url) == store.head()


def test_downgrade_one_step_and_upgrade_again_keeps_data(url: str, tmp_path: Path) -> None:
    store.upgrade(url)
    with sqlite3.connect(tmp_path / "appliance.db") as raw:
        raw.execute(
            "INSERT INTO runs (id, replica_id, name, workload, arrival, knobs, started_at, status)"
            " VALUES ('r1', 'a', 'n', 'w', '{}', '{}', 1.0, 'running')"
        )
    store.downgrade(url, "-1")
    assert store.current(url) == "0007_fleet_sizes"
    with sqlite3.connect(tmp_path / "appliance.db") as raw:
        columns = {row[1] for row in raw.execute("PRAGMA table_info(step_time_models)")}
    assert "noise" not in columns and "gap_s" in columns
    store.downgrade(url, "-1")
    assert store.current(url) == "0006_knob_reasons" and "fleet_sizes" not in _tables_and_indexes(url)[0]
    store.downgrade(url, "-1")
    assert store.current(url) == "0005_prefix_cache"
    with sqlite3.connect(tmp_path / "appliance.db") as raw:
        columns = {row[1] for row in raw.execute("PRAGMA table_info(knob_changes)")}
    assert not {"reason", "prediction"} & columns and "source" in columns
    store.downgrade(url, "-1")
    assert store.current(url) == "0004_binding_counters"
    with sqlite3.connect(tmp_path / "appliance.db") as raw:
        columns = {row[1] for row in raw.execute("PRAGMA table_info(iterations)")}
    assert "prefix_cache_hits" not in columns and "held_by_kv_blocks" in columns
    store.downgrade(url, "-1")
    assert store.current(url) == "0003_step_time_models"
    store.downgrade(url, "-1")
    assert store.current(url) == "0002"
    tables, _ = _tables_and_indexes(url)
    assert tables == TABLES - {"step_time_models", "fleet_sizes"}
    with sqlite3.connect(tmp_path / "appliance.db") as raw:
        columns = {row[1] for row in raw.execute("PRAGMA table_info(iterations)")}
    assert "decode_context_tokens" not in columns and "decode_tokens" in columns
    store.downgrade(url, "-1")
    assert store.current(url) == "0001"
    tables, indexes = _tables_and_indexes(url)
    assert tables == TABLES - {"step_time_models", "fleet_sizes"} and not {i for i in indexes if i.startswith("ix_")}
    store.upgrade(url)
    assert store.current(url) == store.head()
    with sqlite3.connect(tmp_path / "appliance.db") as raw:
        assert raw.execute("SELECT id FROM runs").fetchall() == [("r1",)]
    store.downgrade(url, "base")
    assert store.current(url) is None
    assert _tables_and_indexes(url)[0] == set()


def test_prefix_cache_columns_read_zero_for_older_rows(url: str, tmp_path: Path) -> None:
    store.upgrade(url, "0002")
    with sqlite3.connect(tmp_path / "appliance.db") as raw:
        raw.execute(
            "INSERT INTO requests (replica_id, request_id, source, arrival, finished, prompt_tokens,"
            " output_tokens, finish_reason, preemptions) VALUES ('a', 'x', 'api', 1.0, 2.0, 5, 3, 'stop', 0)"
        )
    store.upgrade(url)
    with sqlite3.connect(tmp_path / "appliance.db") as raw:
        assert raw.execute("SELECT prompt_tokens, cached_tokens FROM requests").fetchall() == [(5, 0)]
    store.downgrade(url, "0002")
    with sqlite3.connect(tmp_path / "appliance.db") as raw:
        columns = {row[1] for row in raw.execute("PRAGMA table_info(requests)")}
        assert "cached_tokens" not in columns
        assert raw.execute("SELECT prompt_tokens FROM requests").fetchall() == [(5,)]


def _diff_from_head(url: str, metadata: MetaData) -> list:
    engine = store.make_engine(url)
    try:
        with engine.connect() as conn:
            opts = {"compare_type": True, "compare_server_default": True}
            return compare_metadata(MigrationContext.configure(conn, opts=opts), metadata)
    finally:
        engine.dispose()


def test_models_match_head(url: str) -> None:
    # Autogenerate's diff between the models and a fresh store at head: tables, columns, types,
    # nullability, defaults, indexes and constraints.
    store.upgrade(url)
    assert _diff_from_head(url, Base.metadata) == []
    assert store.missing_columns(url) == []


def test_a_model_column_without_its_migration_is_caught(url: str) -> None:
    # A metric declared in appliance.records but never migrated: the check above would fail.
    store.upgrade(url)
    unmigrated = MetaData()
    for table in Base.metadata.sorted_tables:
        copy = table.to_metadata(unmigrated)
        if table.name == "iterations":
            copy.append_column(Column("new_metric", Integer(), nullable=False))
    diff = _diff_from_head(url, unmigrated)
    assert [(d[0], d[2], d[3].name) for d in diff] == [("add_column", "iterations", "new_metric")]
    with sqlite3.connect(Path(url.removeprefix("sqlite:///"))) as raw:
        raw.execute("ALTER TABLE requests DROP COLUMN preemptions")
    assert store.missing_columns(url) == ["requests.preemptions"]


def test_sqlite_engine_settings(url: str) -> None:
    engine = store.make_engine(url, busy_timeout_ms=1234, sqlite_pragmas={"max_page_count": 777})
    try:
        with engine.connect() as conn:
            pragma = lambda name: conn.exec_driver_sql(f"PRAGMA {name}").scalar()  # noqa: E731
            assert pragma("journal_mode") == "wal"
            assert pragma("synchronous") == 1  # NORMAL
            assert pragma("busy_timeout") == 1234
            assert pragma("max_page_count") == 777
            assert pragma("foreign_keys") == 1
    finally:
        engine.dispose()
    with pytest.raises(ValueError, match="invalid SQLite pragma"):
        store.make_engine(url, sqlite_pragmas={"max_page_count; DROP TABLE runs": 1})


def test_default_url_is_a_file_in_the_working_folder() -> None:
    assert store.DEFAULT_URL == "sqlite:///appliance.db"


def test_concurrent_upgrades_of_one_file_all_succeed(url: str) -> None:
    # Appliance processes starting together: the migration transaction takes the write lock
    # at BEGIN, so the others wait (up to store.MIGRATION_WAIT_MS) and then find the store
    # already at head.
    code = "import sys; from appliance.telemetry import store; store.upgrade(sys.argv[1])"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, url], stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    errors = [p.communicate(timeout=180)[1] for p in procs if p.wait(timeout=180) != 0]
    assert not errors, "\n".join(errors)  # whole tracebacks: pytest's diff of the list cuts them
    assert store.current(url) == store.head()


def test_an_upgrade_waits_for_another_migration_past_the_engines_busy_timeout(url: str) -> None:
    # The CI machine, loaded, once failed the test above: a process waited at BEGIN IMMEDIATE
    # longer than the store's 5 s busy timeout while another ran the migrations ("database is
    # locked"). Here another connection holds the write lock 10x an engine's busy timeout; the
    # upgrade through that engine waits for it (MIGRATION_WAIT_MS), then migrates.
    store.upgrade(url, "0001")
    engine = store.make_engine(url, busy_timeout_ms=50)
    holder = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.5, holder.commit)
    release.start()
    try:
        store.upgrade(engine)
        assert store.current(engine) == store.head()
        with engine.connect() as conn:  # the pooled connection has the engine's own timeout again
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 50
    finally:
        release.join()
        holder.close()
        engine.dispose()


def test_binding_counters_migration_keeps_rows_and_reads_zero(url: str, tmp_path: Path) -> None:
    store.upgrade(url, "0002")
    cols = ("replica_id, iteration, started_at, duration_s, running, waiting, prefill_seqs, prefill_tokens, "
            "decode_seqs, decode_tokens, scheduled_tokens, padding_tokens, token_budget, max_num_seqs, "
            "kv_blocks_used, kv_blocks_free, kv_blocks_total, preemptions, finished, knob_version, policy")
    with sqlite3.connect(tmp_path / "appliance.db") as raw:
        raw.execute(f"INSERT INTO iterations ({cols}) VALUES ('a', 7, 1.0, 0.1, 1, 2, 0, 0, 1, 1, 1, 0, 512, 64, "
                    "1, 9, 10, 0, 0, 0, 'continuous')")
    store.upgrade(url)
    with sqlite3.connect(tmp_path / "appliance.db") as raw:
        row = raw.execute("SELECT iteration, held_by_max_num_seqs, held_by_kv_blocks, chunk_deferred_tokens "
                          "FROM iterations").fetchall()
    assert row == [(7, 0, 0, 0)]
    assert _diff_from_head(url, Base.metadata) == []
