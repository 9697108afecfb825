"""`appliance simulate` through the real CLI, on runs recorded by `appliance bench` against a real
server whose telemetry goes to a real SQLite store."""

from __future__ import annotations

import contextlib
import io
import json
import random
import re

import pytest
from sqlalchemy import func, select

from appliance.cli import main
from appliance.telemetry import store
from appliance.telemetry.models import StepTimeModelRow
from bench_live_server import telemetry_server


@pytest.fixture(scope="module")
def recorded(server_factory, tmp_path_factory):
    """(db, run of 30 requests at Poisson 10/s, run of one request, the 30 requests), recorded
    with the real `appliance bench` (capsys is per test: stdout is captured by hand here)."""
    tmp = tmp_path_factory.mktemp("sim-cli")
    db = f"sqlite:///{tmp / 'telemetry.db'}"
    rng = random.Random(5)
    requests = [{"prompt_ids": [rng.randrange(100, 20000) for _ in range(rng.randint(5, 80))],
                 "output_len": rng.randint(4, 16)} for _ in range(30)]
    with telemetry_server(server_factory, db, max_num_seqs=8, max_num_batched_tokens=128,
                          long_prefill_token_threshold=32) as srv:
        ids = []
        for name, reqs, extra in (("main", requests, ["--rate", "10"]), ("tiny", requests[:1], [])):
            (tmp / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in reqs) + "\n")
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                status = main(["bench", "--base-url", srv.base_url, "--db", db, "--workload", "jsonl",
                               "--file", str(tmp / f"{name}.jsonl"), "--json", *extra])
            assert status == 0, buf.getvalue()
            ids.append(json.loads(buf.getvalue())["run_id"])
        srv.writer.flush()
    return db, ids[0], ids[1], requests


def simulate(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["simulate", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def stored_models(db: str) -> int:
    with store.using_engine(db) as engine, engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(StepTimeModelRow.__table__)).scalar_one()


def test_replay_at_the_recorded_knobs_serves_every_request_and_keeps_the_model(recorded, capsys):
    db, run_id, _, requests = recorded
    before = stored_models(db)
    status, out, err = simulate(capsys, "--run", run_id, "--db", db, "--json")
    assert status == 0, err
    report = json.loads(out)
    (baseline,) = report["outcomes"]
    assert baseline["label"] == "recorded knobs" and baseline["knobs"]["max_num_seqs"] == 8
    s = baseline["summary"]
    assert s["completed"] == 30 and s["total_output_tokens"] == sum(r["output_len"] for r in requests)
    assert s["total_input_tokens"] == sum(len(r["prompt_ids"]) for r in requests)
    assert report["recorded"]["completed"] == 30
    model = report["model"]
    assert model["run_id"] == run_id and model["rows_used"] + model["rows_held_out"] >= 20
    assert 0 <= model["heldout_mape"] < 10 and model["engine"].startswith(report["run"]["engine"][:10])
    assert stored_models(db) == before + 1
    assert len(baseline["timeline"]["t"]) == len(baseline["timeline"]["kv_usage"]) > 0


def test_a_runs_stored_model_is_reused_and_refit_fits_again(recorded, capsys):
    db, run_id, _, _ = recorded
    status, out, err = simulate(capsys, "--run", run_id, "--db", db, "--json")
    assert status == 0, err
    first, before = json.loads(out)["model"], stored_models(db)
    status, out, err = simulate(capsys, "--run", run_id, "--db", db, "--set", "max_num_seqs=2", "--json")
    assert status == 0, err
    assert json.loads(out)["model"] == first and stored_models(db) == before  # the stored fit, nothing new
    status, out, err = simulate(capsys, "--run", run_id, "--db", db, "--refit", "--json")
    assert status == 0, err
    refit = json.loads(out)["model"]
    assert refit["id"] != first["id"] and stored_models(db) == before + 1
    assert refit["coefficients"] == pytest.approx(first["coefficients"], rel=1e-9)  # the same rows, the same fit


def test_a_run_too_short_to_fit_replays_on_another_runs_fit_or_the_last_hour(recorded, capsys):
    db, run_id, tiny_id, _ = recorded
    status, out, err = simulate(capsys, "--run", tiny_id, "--db", db, "--fit-run", run_id, "--json")
    assert status == 0, err
    report = json.loads(out)
    on_run = report["model"]
    assert on_run["run_id"] == run_id and report["outcomes"][0]["summary"]["completed"] == 1
    status, out, err = simulate(capsys, "--run", tiny_id, "--db", db, "--fit-last", "1h", "--json")
    assert status == 0, err
    window = json.loads(out)["model"]  # the replica's last hour: both runs' iterations
    assert window["run_id"] is None
    assert window["rows_used"] + window["rows_held_out"] > on_run["rows_used"] + on_run["rows_held_out"]


def test_one_sequence_at_a_time_queues_more(recorded, capsys):
    db, run_id, _, _ = recorded
    status, out, err = simulate(capsys, "--run", run_id, "--db", db, "--set", "max_num_seqs=1", "--json")
    assert status == 0, err
    base, one = json.loads(out)["outcomes"]
    assert one["knobs"]["max_num_seqs"] == 1 and one["changes"] == {"max_num_seqs": 1}
    assert one["summary"]["ttft"]["p99"] > base["summary"]["ttft"]["p99"]
    assert max(one["timeline"]["running"]) == 1


def test_grid_replays_every_point_and_skips_invalid_combinations(recorded, capsys):
    db, run_id, _, _ = recorded
    status, out, err = simulate(capsys, "--run", run_id, "--db", db, "--grid", "max_num_seqs=2,64",
                                "--grid", "max_num_batched_tokens=32,256", "--slo", "ttft=2s", "--json")
    assert status == 0, err
    outcomes = json.loads(out)["outcomes"]
    labels = [o["label"] for o in outcomes]
    assert labels == ["recorded knobs", "max_num_seqs=2, max_num_batched_tokens=32",
                      "max_num_seqs=2, max_num_batched_tokens=256", "max_num_seqs=64, max_num_batched_tokens=32",
                      "max_num_seqs=64, max_num_batched_tokens=256"]
    assert [o["skipped"] is not None for o in outcomes] == [False, False, False, True, False]
    assert "max_num_batched_tokens (32) must be >= max_num_seqs (64)" in outcomes[3]["skipped"]
    assert all(o["summary"]["slo_met"] is not None for o in outcomes if not o["skipped"])


def test_text_report_shows_measured_beside_simulated(recorded, capsys):
    db, run_id, _, _ = recorded
    status, out, err = simulate(capsys, "--run", run_id, "--db", db, "--set", "long_prefill_token_threshold=16")
    assert status == 0, err
    assert "held-out error" in out and "recorded (measured)" in out
    assert re.search(r"step times vary \d+\.\d\dx-\d+\.\d\dx around it \(p10-p90", out)
    assert "simulated at the recorded knobs" in out and "long_prefill_token_threshold=16" in out


def test_fleet_sizing_finds_the_fewest_replicas(recorded, capsys):
    db, run_id, _, _ = recorded
    status, out, err = simulate(capsys, "--run", run_id, "--db", db, "--rate", "40", "-n", "120",
                                "--max-replicas", "6", "--slo", "ttft=300ms", "--json")
    fleet = json.loads(out)["fleet"]
    points = fleet["points"]
    assert [p["replicas"] for p in points] == list(range(1, len(points) + 1))
    assert all(p["summary"]["num_requests"] == 120 for p in points)
    if fleet["recommended"] is None:
        assert status == 1 and len(points) == 6 and all(p["attainment"] < 0.9 for p in points)
    else:
        assert status == 0 and points[-1]["replicas"] == fleet["recommended"]
        assert points[-1]["attainment"] >= 0.9 and all(p["attainment"] < 0.9 for p in points[:-1])
    status, out, _ = simulate(capsys, "--run", run_id, "--db", db, "--rate", "5", "--replicas", "2", "--json")
    assert status == 0 and json.loads(out)["fleet"]["points"][0]["replicas"] == 2


@pytest.mark.parametrize("args, message", [
    (["--set", "max_num_seqs=0"], "max_num_seqs: input should be greater than or equal to 1, got 0"),
    (["--set", "speed=11"], "speed: unknown knob"),
    (["--set", "max_num_seqs"], "--set 'max_num_seqs': expected KNOB=VALUE"),
    (["--grid", "max_num_seqs=8,many"], "max_num_seqs: input should be a valid integer, got \"many\""),
    (["--grid", "scheduling_policy=fifo"], "scheduling_policy: input should be 'continuous' or 'static', got \"fifo\""),
    (["--set", "num_blocks=2"], "do not fit in the KV cache (num_blocks 2 x block_size 16 = 32 tokens)"),
    (["--max-replicas", "3", "--rate", "1"], "--max-replicas needs --slo"),
    (["--replicas", "3"], "fleet sizing needs --rate"),
])
def test_bad_input_names_the_value_and_stores_nothing(recorded, capsys, args, message):
    db, run_id, _, _ = recorded
    before = stored_models(db)
    status, out, err = simulate(capsys, "--run", run_id, "--db", db, *args)
    assert status == 2 and out == ""
    assert message in err
    assert stored_models(db) == before


def test_unknown_run_and_a_run_too_short_to_fit(recorded, capsys):
    db, _, tiny_id, _ = recorded
    status, _, err = simulate(capsys, "--run", "no-such-run", "--db", db)
    assert status == 2 and "no run 'no-such-run' in the store" in err
    status, _, err = simulate(capsys, "--run", tiny_id, "--db", db)
    assert status == 2 and "usable iterations" in err and "at least 20" in err


def test_a_bench_workload_spec_replays_on_the_runs_engine(recorded, capsys, tmp_path):
    db, run_id, _, _ = recorded
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(json.dumps({"prompt_ids": list(range(100, 100 + 10 * k)), "output_len": 3 + k})
                              for k in range(1, 9)) + "\n")
    status, out, err = simulate(capsys, "--run", run_id, "--db", db, "--workload", "jsonl", "--file", str(path),
                                "--rate", "4", "--set", "max_num_seqs=2", "--json")
    assert status == 0, err
    report = json.loads(out)
    assert report["workload"].startswith("jsonl") and report["recorded"] is None
    for outcome in report["outcomes"]:
        s = outcome["summary"]
        assert s["completed"] == 8 and s["total_output_tokens"] == sum(3 + k for k in range(1, 9))
        assert s["total_input_tokens"] == sum(10 * k for k in range(1, 9))
    status, out, err = simulate(capsys, "--run", run_id, "--db", db, "--workload", "jsonl", "--file", str(path),
                                "--concurrency", "2", "--json")
    assert status == 0, err
    assert max(json.loads(out)["outcomes"][0]["timeline"]["running"]) <= 2


@pytest.mark.parametrize("line, message", [
    ({"prompt": "text only", "output_len": 4}, "workload request 0: the simulator needs its prompt length"),
    ({"prompt_ids": [5] * 5000, "output_len": 4}, "request 0: 5000 prompt + 4 output tokens = 5004 exceeds max_model_len"),
])
def test_a_workload_the_engine_cannot_take_is_an_error(recorded, capsys, tmp_path, line, message):
    db, run_id, _, _ = recorded
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(line) + "\n")
    before = stored_models(db)
    status, out, err = simulate(capsys, "--run", run_id, "--db", db, "--workload", "jsonl", "--file", str(path))
    assert status == 2 and message in err and stored_models(db) == before


def test_closed_loop_workloads_are_not_offered_to_the_simulator(capsys):
    from appliance.bench.workloads import Conversation
    from appliance.sim import whatif

    with pytest.raises(SystemExit):
        main(["simulate", "--run", "r", "--workload", "multi-turn"])
    assert "invalid choice: 'multi-turn'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="closed-loop workload \\(multi-turn\\)"):
        whatif.workload_requests([Conversation(("hi", "and then?"), 4)], None, 0)
