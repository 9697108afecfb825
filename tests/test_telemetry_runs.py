"""Runs in the telemetry store (real SQLite file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.telemetry import runs, store


@pytest.fixture()
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'appliance.db'}"
    store.upgrade(url)
    return url


def test_create_add_requests_finish_and_read_back(url: str) -> None:
    run_id = runs.create_run(
        url, "sweep-1", "skewed-64", {"process": "poisson", "rate": 4.0}, {"max_num_seqs": 16}, "gpu-0"
    )
    assert len(run_id) == 36
    run = runs.get_run(url, run_id)
    assert run is not None
    assert (run["status"], run["ended_at"], run["summary"]) == ("running", None, None)
    assert run["arrival"] == {"process": "poisson", "rate": 4.0} and run["knobs"] == {"max_num_seqs": 16}

    stored = runs.add_run_requests(
        url,
        run_id,
        [
            {
                "index": 1,
                "ok": False,
                "error_kind": "timeout",
                "requested_output_tokens": 64,
                "start_offset_s": 0.5,
            },
            {
                "index": 0,
                "ok": True,
                "request_id": "cmpl-7",
                "prompt_tokens": 12,
                "output_tokens": 64,
                "requested_output_tokens": 64,
                "ttft_s": 0.2,
                "e2e_s": 1.5,
                "tpot_s": 0.02,
                "itl_s": [0.01, 0.03],
                "itl_mean_s": 0.02,
                "itl_p50_s": 0.02,
                "itl_p99_s": 0.03,
                "start_offset_s": 0.0,
            },
        ],
    )
    assert stored == 2
    runs.finish_run(url, run_id, "completed", {"ttft_p50_s": 0.2, "ok": 1, "errors": 1})
    run = runs.get_run(url, run_id, with_requests=True)
    assert run["status"] == "completed" and run["ended_at"] >= run["started_at"]
    assert run["summary"] == {"ttft_p50_s": 0.2, "ok": 1, "errors": 1}
    first, second = run["requests"]
    assert (first["index"], first["ok"], first["request_id"], first["itl_s"]) == (
        0,
        True,
        "cmpl-7",
        [0.01, 0.03],
    )
    assert (second["index"], second["ok"], second["error_kind"], second["ttft_s"]) == (
        1,
        False,
        "timeout",
        None,
    )
    assert runs.get_run(url, "missing") is None


def test_list_runs_newest_first_with_filters(url: str) -> None:
    ids = [
        runs.create_run(url, f"r{k}", "w", {}, {}, "a" if k % 2 else "b", started_at=100.0 + k)
        for k in range(5)
    ]
    runs.finish_run(url, ids[0], "cancelled")
    assert [r["id"] for r in runs.list_runs(url)] == ids[::-1]
    assert [r["id"] for r in runs.list_runs(url, replica_id="a")] == [ids[3], ids[1]]
    assert [r["id"] for r in runs.list_runs(url, status="cancelled")] == [ids[0]]
    assert len(runs.list_runs(url, limit=2)) == 2


def test_mark_interrupted_runs(url: str) -> None:
    a = runs.create_run(url, "a", "w", {}, {}, "gpu-0")
    b = runs.create_run(url, "b", "w", {}, {}, "gpu-1")
    done = runs.create_run(url, "done", "w", {}, {}, "gpu-0")
    runs.finish_run(url, done, "completed")
    assert runs.mark_interrupted_runs(url, replica_id="gpu-0") == 1
    assert runs.get_run(url, a)["status"] == "interrupted" and runs.get_run(url, a)["ended_at"] is not None
    assert runs.get_run(url, b)["status"] == "running"
    assert runs.get_run(url, done)["status"] == "completed"
    assert runs.mark_interrupted_runs(url) == 1  # every replica
    assert runs.mark_interrupted_runs(url) == 0


def test_bad_input_is_refused_with_the_reason(url: str) -> None:
    run_id = runs.create_run(url, "a", "w", {}, {}, "gpu-0")
    with pytest.raises(
        ValueError, match="run status must be one of completed, cancelled, failed, interrupted"
    ):
        runs.finish_run(url, run_id, "running")
    with pytest.raises(LookupError, match="no run 'nope'"):
        runs.finish_run(url, "nope", "completed")
    with pytest.raises(LookupError, match="no run 'nope'"):
        runs.add_run_requests(url, "nope", [{"index": 0, "ok": True}])
    with pytest.raises(ValueError, match=r"row 0: unknown fields \['ttft'\]; missing fields \['ok'\]"):
        runs.add_run_requests(url, run_id, [{"index": 0, "ttft": 1.0}])
    with pytest.raises(ValueError, match="run status must be one of"):
        runs.list_runs(url, status="done")
    assert runs.add_run_requests(url, run_id, []) == 0
