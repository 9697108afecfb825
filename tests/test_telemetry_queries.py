"""Read-side queries on hand-built data in a real SQLite store (written by the real writer)."""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from pathlib import Path

import pytest

from appliance.engine.stats import IterationStats, KnobChange, RequestStats
from appliance.telemetry import queries, runs, store
from appliance.telemetry.writer import TelemetryWriter

from records_factory import iteration


def _iteration(i: int, t: float, running: int, replica_waiting: int = 0) -> IterationStats:
    return iteration(iteration=i, started_at=t, duration_s=0.001 * (1 + running % 7), running=running,
                     waiting=replica_waiting, decode_seqs=running, decode_tokens=running, scheduled_tokens=running,
                     token_budget=512, max_num_seqs=64, kv_blocks_used=running, kv_blocks_free=1000 - running,
                     kv_blocks_total=1000, knob_version=1, decode_context_tokens=0)


@pytest.fixture()
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'appliance.db'}"


def _write(url: str, records: list, replica_id: str = "r1") -> None:
    with TelemetryWriter(url, replica_id, capacity=len(records) + 1, flush_interval_s=0.05) as writer:
        for record in records:
            if isinstance(record, IterationStats):
                writer.on_iteration(record)
            elif isinstance(record, RequestStats):
                writer.on_request(record)
            else:
                writer.on_knob_change(record)
        assert writer.flush(30)
        assert writer.rows_dropped == 0


def _expected(rows: list[tuple[float, float]], key) -> dict[int, tuple[int, float, float, float]]:  # noqa: ANN001
    groups: dict[int, list[float]] = defaultdict(list)
    for t, v in rows:
        b = key(t)
        if b is not None:
            groups[b].append(v)
    return {b: (len(v), min(v), max(v), sum(v)) for b, v in groups.items()}


def _spiky_rows(
    since: float, width: float, buckets: int, step: float, rng: random.Random
) -> list[tuple[float, int]]:
    """Values 200..300, with in every bucket a spike on its last row and a dip on its first."""
    rows = []
    for b in range(buckets):
        start = since + b * width
        n = int(width / step)
        for k in range(n):
            value = rng.randint(200, 300)
            if k == 0:
                value = b  # dip on the bucket's first row
            if k == n - 1:
                value = 1000 + b  # spike on its last row
            rows.append((start + k * step, value))
    return rows


def test_raw_downsampling_keeps_each_buckets_true_min_and_max(url: str) -> None:
    rng = random.Random(1)
    since, width, buckets = 1_700_000_000.5, 6.0, 10
    until = since + width * buckets
    rows = _spiky_rows(since, width, buckets, 0.25, rng)
    rows += [(since - 0.001, 9999), (until, 9999)]  # just outside the window
    _write(url, [_iteration(i, t, v) for i, (t, v) in enumerate(rows)])

    series = queries.iteration_series(url, "running", since, until, points=buckets, resolution="raw")
    assert series.resolution == "raw" and series.bucket_s == pytest.approx(width)
    expected = _expected(rows, lambda t: math.floor((t - since) / width) if since <= t < until else None)
    got = {round((p.t - since) / width): (p.count, p.min, p.max, p.sum) for p in series.points}
    assert got == expected
    for b, point in enumerate(series.points):
        assert (point.min, point.max) == (b, 1000 + b)
        assert point.mean == pytest.approx(point.sum / point.count)


def test_rollup_downsampling_keeps_each_buckets_true_min_and_max(url: str) -> None:
    rng = random.Random(2)
    since, width, buckets = 1_700_000_000, 12, 50  # whole seconds: served from the rollup
    until = since + width * buckets
    rows = _spiky_rows(since, width, buckets, 0.1, rng)
    rows += [(since - 0.5, 9999), (until + 0.01, 9999)]
    _write(url, [_iteration(i, t, v) for i, (t, v) in enumerate(rows)])

    series = queries.iteration_series(url, "running", since, until, points=buckets)
    assert series.resolution == "rollup" and series.bucket_s == width
    assert (series.since, series.until) == (since, until)
    expected = _expected(rows, lambda t: (math.floor(t) - since) // width if since <= t < until else None)
    got = {int((p.t - since) // width): (p.count, p.min, p.max, p.sum) for p in series.points}
    assert got == expected
    assert [(p.min, p.max) for p in series.points] == [(b, 1000 + b) for b in range(buckets)]


def test_raw_and_rollup_agree_on_whole_second_buckets(url: str) -> None:
    rng = random.Random(3)
    t0 = 1_700_000_000
    rows = [(t0 + rng.random() * 100, rng.randint(0, 64)) for _ in range(3000)]
    _write(url, [_iteration(i, t, v) for i, (t, v) in enumerate(sorted(rows))])
    for column in ("running", "duration_s", "kv_blocks_free"):
        raw = queries.iteration_series(url, column, t0, t0 + 100, points=10, resolution="raw")
        rolled = queries.iteration_series(url, column, t0, t0 + 100, points=10, resolution="rollup")
        assert [(p.t, p.count, p.min, p.max) for p in raw.points] == [
            (p.t, p.count, p.min, p.max) for p in rolled.points
        ]
        assert [p.sum for p in raw.points] == pytest.approx([p.sum for p in rolled.points])


def test_rollup_is_exact_when_a_second_spans_several_batches(url: str) -> None:
    t0 = 1_700_000_000
    with TelemetryWriter(url, "r1", flush_interval_s=0.05) as writer:
        for part in range(4):  # the same two seconds, written in four transactions
            for k in range(50):
                writer.on_iteration(_iteration(part * 50 + k, t0 + (k * 4 + part) * 0.01, part * 50 + k))
            assert writer.flush(10)
    series = queries.iteration_series(url, "running", t0, t0 + 2, points=1, resolution="rollup")
    (point,) = series.points
    assert (point.count, point.min, point.max, point.sum) == (200, 0, 199, sum(range(200)))


def test_auto_resolution_and_point_budget(url: str) -> None:
    now = time.time()
    _write(url, [_iteration(i, now - 3600 + i * 0.9, i % 50) for i in range(4000)])
    hour = queries.iteration_series(url, "running", now - 3600, now, points=500)
    assert hour.resolution == "rollup" and len(hour.points) <= 500
    assert sum(p.count for p in hour.points) == 4000
    recent = queries.iteration_series(url, "running", now - 60, now, points=500)
    assert recent.resolution == "raw" and len(recent.points) <= 500
    default_window = queries.iteration_series(url, "running")  # the last hour
    assert sum(p.count for p in default_window.points) >= 3990


def test_replica_and_run_scoping(url: str) -> None:
    t0 = 1_700_000_000
    _write(url, [_iteration(i, t0 + i, 5) for i in range(100)], "a")
    _write(url, [_iteration(i, t0 + i, 7) for i in range(100)], "b")
    run_id = runs.create_run(url, "r", "w", {}, {}, "b", started_at=t0 + 10)
    runs.finish_run(url, run_id, "completed", ended_at=t0 + 30)
    a = queries.iteration_series(url, "running", t0, t0 + 100, replica_id="a", points=5)
    assert {p.max for p in a.points} == {5} and sum(p.count for p in a.points) == 100
    both = queries.iteration_series(url, "running", t0, t0 + 100, points=5)
    assert sum(p.count for p in both.points) == 200
    during = queries.iteration_series(url, "running", run_id=run_id, points=100)
    assert sum(p.count for p in during.points) == 20 and {p.max for p in during.points} == {7}
    with pytest.raises(LookupError, match="no run"):
        queries.iteration_series(url, "running", run_id="nope")


def test_latest_and_counts(url: str) -> None:
    t0 = time.time() - 100
    _write(url, [_iteration(i, t0 + i, i) for i in range(10)], "a")
    _write(url, [_iteration(i, t0 + i + 0.5, 100 + i) for i in range(3)], "b")
    _write(url, [RequestStats("x", "api", None, t0, t0, t0, t0 + 1, 1, 1, "stop", 0, 0)], "a")
    latest = queries.latest(url)
    assert latest["iteration"]["replica_id"] == "a" and latest["iteration"]["iteration"] == 9
    assert latest["iterations"] == 13 and latest["requests"] == 1 and latest["rows_dropped"] == 0
    b = queries.latest(url, "b")
    assert b["iteration"]["running"] == 102 and b["iterations"] == 3 and b["requests"] == 0
    assert queries.latest(url, "nobody")["iteration"] is None


def _request(
    rid: str, run_id: str | None, arrival: float, ttft: float, e2e: float, out: int, reason: str = "stop"
) -> RequestStats:
    return RequestStats(
        rid,
        "loadtest",
        run_id,
        arrival,
        arrival + ttft / 2,
        arrival + ttft,
        arrival + e2e,
        10,
        out,
        reason,
        0,
        0,
    )


def test_run_summary_from_request_rows(url: str) -> None:
    store.upgrade(url)
    run_id = runs.create_run(url, "r", "w", {}, {}, "r1")
    t0 = 1_700_000_000.0
    ttfts = [0.1 * (k + 1) for k in range(10)]  # 0.1 .. 1.0
    records = [_request(f"q{k}", run_id, t0 + k, ttfts[k], ttfts[k] + 2.0, 21) for k in range(10)]
    records.append(_request("aborted", run_id, t0 + 3, 0.5, 0.6, 1, "abort"))
    records.append(_request("other-run", None, t0, 50.0, 60.0, 5))
    _write(url, records)
    s = queries.run_summary(url, run_id)
    assert s["requests"] == 11 and s["finish_reasons"] == {"stop": 10, "abort": 1}
    assert s["output_tokens"] == 211 and s["prompt_tokens"] == 110
    assert s["ttft_s"]["p50"] == pytest.approx(sorted(ttfts + [0.5])[5])
    assert s["ttft_s"]["max"] == pytest.approx(1.0)
    assert s["e2e_s"]["p50"] == pytest.approx(2.55)  # aborted requests are not in E2E
    assert s["itl_s"]["p50"] == pytest.approx(0.1)  # 2 s for 20 further tokens
    assert s["duration_s"] == pytest.approx(9 + 3.0)
    assert s["output_tokens_per_s"] == pytest.approx(211 / 12.0)
    empty = queries.run_summary(url, "no-requests")
    assert empty["requests"] == 0 and empty["ttft_s"] is None


def test_latency_series_percentiles_per_bucket(url: str) -> None:
    t0 = 1_700_000_000.0
    first = [_request(f"a{k}", None, t0 + k * 0.05, 0.01 * (k + 1), 1.0, 5) for k in range(100)]
    second = [_request(f"b{k}", None, t0 + 10 + k * 0.05, 1.0, 2.0, 5) for k in range(10)]
    _write(url, first + second)
    points = queries.latency_series(url, "ttft", t0, t0 + 20, points=2)
    assert [p.count for p in points] == [100, 10]
    assert points[0].quantiles["p50"] == pytest.approx(0.505)
    assert points[0].quantiles["p99"] == pytest.approx(0.9901)
    assert points[1].quantiles == pytest.approx({"p50": 1.0, "p90": 1.0, "p99": 1.0})
    e2e = queries.latency_series(url, "e2e", t0, t0 + 20, points=1, quantiles=(0.5,))
    assert e2e[0].count == 110 and set(e2e[0].quantiles) == {"p50"}
    with pytest.raises(ValueError, match="unknown latency metric"):
        queries.latency_series(url, "tbt")


def test_knob_timeline(url: str) -> None:
    t0 = 1_700_000_000.0
    _write(
        url,
        [
            KnobChange(2, 10, t0 + 5, {"max_num_seqs": 64}, {"max_num_seqs": 8}, "api"),
            KnobChange(3, 20, t0 + 9, {"max_num_seqs": 8}, {"max_num_seqs": 16}, "tune"),
        ],
        "a",
    )
    _write(
        url,
        [
            KnobChange(
                2, 4, t0 + 7, {"scheduling_policy": "continuous"}, {"scheduling_policy": "static"}, "api"
            )
        ],
        "b",
    )
    timeline = queries.knob_timeline(url)
    assert [(k["replica_id"], k["version"]) for k in timeline] == [("a", 2), ("b", 2), ("a", 3)]
    assert timeline[0]["new"] == {"max_num_seqs": 8} and timeline[0]["iteration"] == 10
    assert [k["version"] for k in queries.knob_timeline(url, t0 + 6, replica_id="a")] == [3]


def test_bad_arguments_are_named(url: str) -> None:
    store.upgrade(url)
    with pytest.raises(ValueError, match="unknown iteration column 'policy'"):
        queries.iteration_series(url, "policy")
    with pytest.raises(ValueError, match="points must be a positive integer"):
        queries.iteration_series(url, "running", points=0)
    with pytest.raises(ValueError, match="must be after since"):
        queries.iteration_series(url, "running", 10.0, 5.0)
    with pytest.raises(ValueError, match="resolution"):
        queries.iteration_series(url, "running", resolution="fine")
