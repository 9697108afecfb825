"""`appliance tune --simulate`: the grid ranked by replay, only the top points measured live, the
report showing predicted beside measured (real server, real store, real CLI)."""

from __future__ import annotations

import contextlib
import io
import json
import random

import httpx
import pytest

from appliance.cli import main
from bench_live_server import telemetry_server


@pytest.fixture(scope="module")
def server(server_factory, tmp_path_factory):
    """A live server with a recorded run of 24 requests at Poisson 12/s (for the fit) and a small
    workload file for the sweep."""
    tmp = tmp_path_factory.mktemp("sim-tune")
    db = f"sqlite:///{tmp / 'telemetry.db'}"
    rng = random.Random(2)
    lines = [json.dumps({"prompt_ids": [rng.randrange(100, 20000) for _ in range(rng.randint(5, 60))],
                         "output_len": rng.randint(3, 10)}) for _ in range(24)]
    (tmp / "record.jsonl").write_text("\n".join(lines) + "\n")
    (tmp / "sweep.jsonl").write_text("\n".join(lines[:4]) + "\n")
    with telemetry_server(server_factory, db, max_num_seqs=8, max_num_batched_tokens=64,
                          long_prefill_token_threshold=32) as srv:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["bench", "--base-url", srv.base_url, "--db", db, "--workload", "jsonl", "--file",
                         str(tmp / "record.jsonl"), "--rate", "12", "--json"]) == 0
        srv.writer.flush()
        srv.db, srv.run_id, srv.sweep_file = db, json.loads(buf.getvalue())["run_id"], tmp / "sweep.jsonl"
        yield srv


def test_simulated_sweep_measures_only_the_top_points(server, tmp_path, capsys):
    before = httpx.get(f"{server.base_url}/admin/knobs").json()["knobs"]
    report = tmp_path / "sweep.md"
    status = main(["tune", "--base-url", server.base_url, "--workload", "jsonl", "--file", str(server.sweep_file),
                   "--db", server.db, "--slo", "e2e=120s", "--max-num-seqs", "1,2,4", "--max-num-batched-tokens",
                   "4,64", "--chunk-sizes", "16,32", "--simulate", server.run_id, "--verify", "2",
                   "--report", str(report)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "ranked 6 grid points in simulation" in captured.err  # budget 4 < chunk: 6 of 12 invalid
    assert "measuring the top 2 live" in captured.err
    text = report.read_text()
    assert text.count("| simulated |") == 2 and "| coarse |" not in text and "| refine |" not in text
    section = text.split("## Predicted vs measured")[1]
    assert section.count(" / ") >= 2 * 5  # five sim / live pairs per measured point
    assert httpx.get(f"{server.base_url}/admin/knobs").json()["knobs"] == before  # restored


def test_simulate_with_an_unknown_run_is_an_error_and_changes_nothing(server, capsys):
    before = httpx.get(f"{server.base_url}/admin/knobs").json()
    status = main(["tune", "--base-url", server.base_url, "--workload", "jsonl", "--file", str(server.sweep_file),
                   "--db", server.db, "--slo", "e2e=120s", "--simulate", "nope"])
    assert status == 2 and "no run 'nope' in the store" in capsys.readouterr().err
    assert httpx.get(f"{server.base_url}/admin/knobs").json() == before
