"""The telemetry store on a real PostgreSQL server: migrations, two replicas writing to one
database, and queries that keep them apart.

The fixture starts a throwaway server (tests/pg_server.py), or uses $APPLIANCE_TEST_PG_URL when
set; it is skipped, with the reason, only when no server can be started here."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

from appliance.engine.stats import IterationStats, KnobChange, RequestStats
from appliance.telemetry import queries, runs, store
from appliance.telemetry.models import Base
from appliance.telemetry.writer import TelemetryWriter

from pg_server import postgres_server
from records_factory import iteration

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    if os.environ.get("APPLIANCE_TEST_PG_URL"):
        yield os.environ["APPLIANCE_TEST_PG_URL"]
        return
    with postgres_server() as server:
        yield server.url


@pytest.fixture()
def pg_store(pg_url: str) -> Iterator[str]:
    """An empty database at head for each test."""
    store.downgrade(pg_url, "base")
    store.upgrade(pg_url)
    yield pg_url
    store.downgrade(pg_url, "base")


def _iteration(i: int, t: float, running: int) -> IterationStats:
    return iteration(iteration=i, started_at=t, duration_s=0.01, running=running, decode_seqs=running,
                     decode_tokens=running, scheduled_tokens=running, token_budget=512, max_num_seqs=64,
                     kv_blocks_used=running, kv_blocks_free=100 - running, kv_blocks_total=100, knob_version=1,
                     decode_context_tokens=0)


def test_migrations_on_postgres(pg_url: str) -> None:
    store.downgrade(pg_url, "base")
    assert store.current(pg_url) is None
    store.upgrade(pg_url)
    assert store.current(pg_url) == store.head()
    store.downgrade(pg_url, "-1")
    assert store.current(pg_url) == store.revisions()[1]  # one step below head
    store.upgrade(pg_url)
    engine = store.make_engine(pg_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(ctx, Base.metadata) == []
    finally:
        engine.dispose()


def test_two_replicas_share_one_database(pg_store: str) -> None:
    t0 = time.time() - 600
    writers = {
        rid: TelemetryWriter(pg_store, rid, flush_interval_s=0.05).start() for rid in ("gpu-a", "gpu-b")
    }
    # Both write concurrently, interleaved in time; replica a runs 10 seqs, b runs 30.
    for i in range(3000):
        for rid, running in (("gpu-a", 10), ("gpu-b", 30)):
            writers[rid].on_iteration(_iteration(i, t0 + i * 0.1, running))
    writers["gpu-a"].on_request(
        RequestStats("a-1", "api", None, t0, t0 + 0.1, t0 + 0.2, t0 + 1, 5, 9, "stop", 0, 0)
    )
    writers["gpu-b"].on_knob_change(
        KnobChange(2, 7, t0 + 5, {"max_num_seqs": 64}, {"max_num_seqs": 32}, "api")
    )
    for w in writers.values():
        assert w.flush(30)
        assert w.close()
        assert w.rows_dropped == 0

    engine = store.make_engine(pg_store)
    try:
        with engine.connect() as conn:
            counts = dict(
                conn.execute(text("SELECT replica_id, count(*) FROM iterations GROUP BY replica_id")).all()
            )
        assert counts == {"gpu-a": 3000, "gpu-b": 3000}
        for rid, running in (("gpu-a", 10), ("gpu-b", 30)):
            for resolution in ("raw", "rollup"):
                series = queries.iteration_series(
                    engine, "running", t0, t0 + 300, replica_id=rid, points=50, resolution=resolution
                )
                assert sum(p.count for p in series.points) == 3000
                assert {p.min for p in series.points} == {running}
                assert {p.max for p in series.points} == {running}
            last = queries.latest(engine, rid)
            assert last["iteration"]["replica_id"] == rid and last["iteration"]["iteration"] == 2999
            assert last["iterations"] == 3000
        both = queries.iteration_series(engine, "running", t0, t0 + 300, points=10)
        assert sum(p.count for p in both.points) == 6000
        assert (both.points[0].min, both.points[0].max) == (10, 30)
        assert queries.latest(engine, "gpu-a")["requests"] == 1
        assert queries.latest(engine, "gpu-b")["requests"] == 0
        assert [k["replica_id"] for k in queries.knob_timeline(engine)] == ["gpu-b"]
        assert queries.knob_timeline(engine, replica_id="gpu-a") == []
    finally:
        engine.dispose()


def test_runs_on_postgres(pg_store: str) -> None:
    a = runs.create_run(pg_store, "a", "skewed-64", {"rate": 2.0}, {"max_num_seqs": 8}, "gpu-a")
    b = runs.create_run(pg_store, "b", "skewed-64", {"rate": 4.0}, {"max_num_seqs": 16}, "gpu-b")
    runs.add_run_requests(pg_store, a, [{"index": 0, "ok": True, "ttft_s": 0.1, "itl_s": [0.01, 0.02]}])
    assert runs.mark_interrupted_runs(pg_store, "gpu-a") == 1
    assert runs.get_run(pg_store, a)["status"] == "interrupted"
    assert runs.get_run(pg_store, b)["status"] == "running"
    runs.finish_run(pg_store, b, "completed", {"ttft_p50_s": 0.2})
    got = runs.get_run(pg_store, b)
    assert got["status"] == "completed" and got["summary"] == {"ttft_p50_s": 0.2}
    assert runs.get_run(pg_store, a, with_requests=True)["requests"][0]["itl_s"] == [0.01, 0.02]
