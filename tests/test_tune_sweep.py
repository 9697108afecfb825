"""The tuning sweep: the Pareto front's maths on any points (hypothesis), the refinement grid,
and a tiny sweep on a real server by live knob changes (invalid points skipped, the
recommendation applied with apply=True, the original knobs restored otherwise)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.bench.metrics import parse_slo
from appliance.bench.tune import Grid, SweepPoint, pareto_front, refine_points, run_sweep
from appliance.bench.report.sweep import render_sweep
from appliance.bench.workloads import BenchRequest, skewed_corpus_ids
from appliance.cli import main
from appliance.telemetry import runs
from bench_live_server import telemetry_server

REQUESTS = [BenchRequest(None, skewed_corpus_ids()[10 * i: 10 * i + 4 + i], 3 + i % 2) for i in range(4)]


def dominated(a: SweepPoint, b: SweepPoint, latency: str) -> bool:
    """b dominates a."""
    ta, tb, la, lb = a.output_throughput, b.output_throughput, getattr(a, latency), getattr(b, latency)
    return tb >= ta and lb <= la and (tb > ta or lb < la)


values = st.floats(min_value=0.001, max_value=1000, allow_nan=False)


@given(st.lists(st.tuples(values, values, st.booleans()), min_size=1, max_size=25))
def test_pareto_front_is_exactly_the_non_dominated_points(raw):
    points = [SweepPoint({"max_num_seqs": i, "max_num_batched_tokens": i, "long_prefill_token_threshold": i},
                         "coarse", status="ok" if ok else "skipped", output_throughput=t, ttft_p99=l)
              for i, (t, l, ok) in enumerate(raw)]
    front = pareto_front(points, "ttft_p99")
    measured = [i for i, p in enumerate(points) if p.status == "ok"]
    for i in measured:
        beaten = any(dominated(points[i], points[j], "ttft_p99") for j in measured if j != i)
        assert (i in front) == (not beaten)
    assert set(front) <= set(measured)
    throughputs = [points[i].output_throughput for i in front]
    assert throughputs == sorted(throughputs, reverse=True)


def test_refinement_takes_midpoints_towards_the_neighbours():
    grid = Grid(max_num_seqs=(4, 16, 64), max_num_batched_tokens=(256, 1024), long_prefill_token_threshold=(64,))
    best = {"max_num_seqs": 16, "max_num_batched_tokens": 1024, "long_prefill_token_threshold": 64}
    assert refine_points(grid, best) == [
        {**best, "max_num_seqs": 8}, {**best, "max_num_seqs": 32}, {**best, "max_num_batched_tokens": 512}]
    with pytest.raises(ValueError, match="positive integers"):
        Grid(max_num_seqs=(0, 4))


@pytest.fixture(scope="module")
def server(server_factory, tmp_path_factory):
    db = f"sqlite:///{tmp_path_factory.mktemp('tune') / 'telemetry.db'}"
    with telemetry_server(server_factory, db) as srv:
        srv.db = db
        yield srv


def knobs(server) -> dict:
    return httpx.get(f"{server.base_url}/admin/knobs").json()["knobs"]


def test_tiny_sweep_applies_the_recommendation(server):
    before = knobs(server)
    grid = Grid(max_num_seqs=(1, 4), max_num_batched_tokens=(4, 64), long_prefill_token_threshold=(16,))
    lines: list[str] = []
    result = run_sweep(REQUESTS, parse_slo("ttft=60s,e2e=120s"), base_url=server.base_url, grid=grid,
                       apply=True, db_url=server.db, workload="tiny", progress=lines.append)
    by_stage = {}
    for p in result.points:
        by_stage.setdefault(p.stage, []).append(p)
    # budget 4 < chunk 16: both such points are skipped with the validator's reason
    skipped = [p for p in result.points if p.status == "skipped"]
    assert {p.knobs["max_num_batched_tokens"] for p in skipped} == {4} and len(skipped) == 2
    assert all("long_prefill_token_threshold" in p.reason for p in skipped)
    measured = [p for p in result.points if p.status == "ok"]
    assert len(by_stage["coarse"]) == 4 and by_stage["refine"]  # refined around the best point
    assert all(p.output_throughput > 0 and p.ttft_p99 > 0 and p.itl_p99 > 0 for p in measured)
    for p in measured:  # every measured point is a stored run with its knobs in force
        stored = runs.get_run(server.db, p.run_id)
        assert stored["status"] == "completed" and stored["knobs"]["knobs"] | p.knobs == stored["knobs"]["knobs"]
    for front, latency in ((result.pareto_ttft, "ttft_p99"), (result.pareto_itl, "itl_p99")):
        assert front
        for i in front:  # no point on the front is dominated by any measured point
            assert not any(dominated(result.points[i], q, latency) for q in measured if q is not result.points[i])
    rec = result.recommendation
    assert rec is not None and rec.meets_slo
    assert rec.goodput == max(p.goodput for p in measured if p.meets_slo)
    assert result.applied == rec.knobs
    assert knobs(server) == {**before, **rec.knobs}  # GET /admin/knobs shows it
    assert len(lines) == len(result.points)
    report = render_sweep(result, "html")
    assert "Pareto front" in report and "http://" not in report and "https://" not in report
    assert json.loads(render_sweep(result, "json"))["recommendation"] == rec.knobs
    httpx.patch(f"{server.base_url}/admin/knobs", json={k: before[k] for k in rec.knobs}).raise_for_status()


def test_tune_command_restores_the_knobs_without_apply(server, tmp_path, capsys):
    before = knobs(server)
    file = tmp_path / "w.jsonl"
    file.write_text("".join(json.dumps({"prompt_ids": r.prompt_ids, "output_len": r.output_len}) + "\n"
                            for r in REQUESTS[:2]))
    report = tmp_path / "sweep.md"
    code = main(["tune", "--base-url", server.base_url, "--workload", "jsonl", "--file", str(file),
                 "--db", server.db, "--slo", "ttft=1ms", "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
                 "--chunk-sizes", "8,16", "--no-refine", "--report", str(report)])
    captured = capsys.readouterr()
    assert code == 1  # nobody answers in 1 ms: nothing recommended
    assert "No point met the SLO" in captured.out
    assert knobs(server) == before
    text = report.read_text()
    assert text.startswith("# Tuning sweep") and text.count("| coarse |") == 2
    assert main(["tune", "--base-url", server.base_url, "--workload", "jsonl", "--file", str(file)]) == 2
    assert "--slo is required" in capsys.readouterr().err
