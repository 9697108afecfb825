"""`appliance bench --ab` against a real server: continuous then static on the same server
(switched live, then restored), both runs stored, and the static run's padding read from the
iteration telemetry when output lengths differ."""

from __future__ import annotations

import json

import httpx
import pytest
from sqlalchemy import func, select

from appliance.cli import main
from appliance.telemetry import runs
from appliance.telemetry.models import Iteration
from appliance.telemetry.store import using_engine
from bench_live_server import REPLICA, telemetry_server

OUTPUT_LENS = [2, 9, 4, 6]  # differing lengths: the short ones wait as padding for the 9


@pytest.fixture(scope="module")
def server(server_factory, tmp_path_factory):
    db = f"sqlite:///{tmp_path_factory.mktemp('ab') / 'telemetry.db'}"
    with telemetry_server(server_factory, db) as srv:
        srv.db = db
        yield srv


def padding_in(db, run):
    it = Iteration.__table__
    with using_engine(db) as engine, engine.connect() as conn:
        return conn.execute(
            select(func.sum(it.c.padding_tokens), func.sum(it.c.scheduled_tokens), func.count(),
                   func.min(it.c.policy), func.max(it.c.policy))
            .where(it.c.replica_id == REPLICA, it.c.started_at >= run["started_at"],
                   it.c.started_at <= run["ended_at"])).one()


def test_ab_runs_both_policies_and_measures_the_convoy(server, tmp_path, capsys):
    file = tmp_path / "ab.jsonl"
    file.write_text("".join(json.dumps({"prompt": f"Count to {n}:", "output_len": n}) + "\n" for n in OUTPUT_LENS))
    code = main(["bench", "--ab", "--base-url", server.base_url, "--workload", "jsonl", "--file", str(file),
                 "--db", server.db, "--json", "--name", "ab"])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(out)
    assert result["original_policy"] == "continuous"
    assert list(result["runs"]) == ["continuous", "static"]
    # the policy was switched live for each run and restored afterwards
    assert httpx.get(f"{server.base_url}/admin/knobs").json()["knobs"]["scheduling_policy"] == "continuous"
    for policy, described in result["runs"].items():
        stored = runs.get_run(server.db, described["run_id"], with_requests=True)
        assert stored["status"] == "completed" and stored["name"] == f"ab [{policy}]"
        assert stored["knobs"]["knobs"]["scheduling_policy"] == policy
        assert sorted(r["output_tokens"] for r in stored["requests"]) == sorted(OUTPUT_LENS)
        padding, scheduled, iterations, low, high = padding_in(server.db, stored)
        assert low == high == policy  # every iteration of the run ran under its policy
        figures = result["iterations"][policy]
        assert figures["padding_tokens"] == padding and figures["scheduled_tokens"] == scheduled
        assert figures["iterations"] == iterations
    assert result["iterations"]["continuous"]["padding_tokens"] == 0
    static = result["iterations"]["static"]
    # one static batch: each shorter request idles as padding until the 9-token one ends
    assert static["padding_tokens"] > 0
    assert static["padding_share"] == pytest.approx(
        static["padding_tokens"] / (static["padding_tokens"] + static["scheduled_tokens"]))
    assert result["ratios_static_over_continuous"]["output_throughput"] > 0
    assert result["telemetry_note"] is None


def test_ab_table_and_refusal_of_other_servers(server, tmp_path, capsys):
    file = tmp_path / "one.jsonl"
    file.write_text(json.dumps({"prompt": "Hi", "output_len": 2}) + "\n")
    assert main(["bench", "--ab", "--base-url", server.base_url, "--workload", "jsonl", "--file", str(file),
                 "--db", server.db]) == 0
    out = capsys.readouterr().out
    assert "continuous" in out and "static" in out and "static/cont." in out
    assert "scheduling_policy restored to continuous" in out
    code = main(["bench", "--ab", "--base-url", "http://127.0.0.1:9", "--workload", "jsonl",
                 "--file", str(file), "--db", server.db])
    assert code == 2 and "cannot reach" in capsys.readouterr().err
