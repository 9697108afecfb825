"""`appliance bench` (bench_main) and run_benchmark: a real HTTP server on 127.0.0.1 (the
OpenAI-shaped stub of bench_fake_server) and a real SQLite telemetry store in a temp folder."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import pytest

from appliance.bench.cli import add_bench_arguments, bench_main
from appliance.bench.loadgen import BenchError, LoadGenerator
from appliance.bench.runner import run_benchmark
from appliance.bench.workloads import BenchRequest, skewed
from appliance.telemetry import runs
from bench_fake_server import FakeState, serve


@pytest.fixture
def fake():
    state = FakeState()
    with serve(state) as url:
        yield url, state


@pytest.fixture
def db(tmp_path):
    return f"sqlite:///{tmp_path / 'telemetry.db'}"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="appliance bench")
    add_bench_arguments(parser)
    return parser.parse_args(list(argv))


def write_jsonl(path, prompts, output_len=3):
    path.write_text("".join(json.dumps({"prompt": p, "output_len": output_len}) + "\n" for p in prompts))
    return str(path)


def test_json_run_is_printed_and_stored(fake, db, tmp_path, capsys):
    url, state = fake
    file = write_jsonl(tmp_path / "w.jsonl", ["one", "two", "three", "four"])
    code = bench_main(parse("--base-url", url, "--workload", "jsonl", "--file", file, "--json",
                            "--db", db, "--concurrency", "2", "--name", "smoke",
                            "--slo", "ttft=2s,e2e=5s"))
    out, err = capsys.readouterr()
    assert code == 0
    report = json.loads(out)  # one JSON object on stdout; progress went to stderr
    assert "4/4 done" in err
    assert report["name"] == "smoke" and report["status"] == "completed" and report["stored"]
    assert report["summary"]["completed"] == 4 and report["summary"]["slo_met"] == 4
    assert report["arrival"]["mode"] == "concurrency" and report["replica_id"] == "fake-replica"
    assert {b["appliance_run_id"] for b in state.bodies} == {report["run_id"]}

    stored = runs.get_run(db, report["run_id"], with_requests=True)
    assert stored["status"] == "completed" and stored["name"] == "smoke"
    assert stored["replica_id"] == "fake-replica"
    assert stored["knobs"]["knobs"] == {"max_num_seqs": 8}
    assert stored["summary"]["summary"]["completed"] == 4
    rows = stored["requests"]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert all(r["ok"] and r["output_tokens"] == 3 and r["requested_output_tokens"] == 3 for r in rows)
    assert all(len(r["itl_s"]) == 2 and r["ttft_s"] > 0 and r["start_offset_s"] >= 0 for r in rows)
    assert {r["request_id"] for r in rows} == {f"cmpl-{i}" for i in range(1, 5)}


def test_text_summary_and_failures_exit_1(fake, db, tmp_path, capsys):
    url, _ = fake
    file = write_jsonl(tmp_path / "w.jsonl", ["fine", "http500", "http429", "fine"])
    code = bench_main(parse("--base-url", url, "--workload", "jsonl", "--file", file, "--db", db,
                            "-n", "3"))
    out, _ = capsys.readouterr()
    assert code == 1
    assert "Completed               1/3" in out
    assert "http_429: 1, http_5xx: 1" in out
    assert "Request throughput" in out and "TTFT" in out and f"Stored in {db}" in out
    assert "Prefix cache hit rate" in out


def test_packaged_skewed_workload_is_sent_as_token_ids(fake, db, capsys):
    url, state = fake
    assert bench_main(parse("--base-url", url, "--db", db, "--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "skewed n=64 seed=0"
    sent = sorted(state.bodies, key=lambda b: int(b["max_tokens"]) * 10_000 + len(b["prompt"]))
    expected = sorted(skewed(64, 0), key=lambda r: r.output_len * 10_000 + len(r.prompt_ids))
    assert [(b["prompt"], b["max_tokens"]) for b in sent] == [(r.prompt_ids, r.output_len) for r in expected]
    assert report["summary"]["total_output_tokens"] == 4608


def test_duration_limit_exits_1_and_is_stored_completed(fake, db, tmp_path, capsys):
    url, state = fake
    state.token_delay = 0.05
    file = write_jsonl(tmp_path / "w.jsonl", ["slow"] * 3, output_len=100)
    code = bench_main(parse("--base-url", url, "--workload", "jsonl", "--file", file, "--db", db,
                            "--duration", "0.3", "--json"))
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["stopped"] == "duration" and report["status"] == "completed"
    assert report["summary"]["errors"] == {"cancelled": 3}
    assert runs.get_run(db, report["run_id"])["status"] == "completed"


def test_start_errors_exit_2(db, tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    file = write_jsonl(tmp_path / "w.jsonl", ["x"])
    assert bench_main(parse("--base-url", closed, "--workload", "jsonl", "--file", file, "--db", db)) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert bench_main(parse("--workload", "jsonl")) == 2
    assert "needs --file" in capsys.readouterr().err
    assert bench_main(parse("--file", file)) == 2
    assert "only used with --workload jsonl" in capsys.readouterr().err
    assert bench_main(parse("--workload", "jsonl", "--file", file, "-n", "5")) == 2
    assert "has only 1 requests" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": 3}\n')
    assert bench_main(parse("--workload", "jsonl", "--file", str(tmp_path / "bad.jsonl"))) == 2
    assert "bad.jsonl:2:" in capsys.readouterr().err


def test_unusable_store_fails_before_any_request(fake, tmp_path, capsys):
    url, state = fake
    file = write_jsonl(tmp_path / "w.jsonl", ["x"])
    bad_db = f"sqlite:///{tmp_path / 'no-such-dir' / 'x.db'}"
    assert bench_main(parse("--base-url", url, "--workload", "jsonl", "--file", file, "--db", bad_db)) == 2
    assert "cannot store the run" in capsys.readouterr().err
    assert state.bodies == []


def test_argument_errors(capsys):
    with pytest.raises(SystemExit):
        parse("--rate", "2", "--concurrency", "3")
    with pytest.raises(SystemExit):
        parse("--slo", "ttft=500")
    assert "'ttft=500': add a unit" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--num-requests", "0")
    assert parse("--rate", "2.5").rate == 2.5


def test_run_benchmark_cancel_from_another_thread_is_stored_cancelled(fake, db):
    url, state = fake
    state.token_delay = 0.1  # each answer streams for 10 s: cancelled long before it ends
    gen = LoadGenerator([BenchRequest("x", None, 100)] * 3, base_url=url)

    def cancel_once_all_are_in_flight() -> None:  # not on a timer: a slow machine sends later
        deadline = time.monotonic() + 60
        while len(state.bodies) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        gen.cancel()

    canceller = threading.Thread(target=cancel_once_all_are_in_flight)
    canceller.start()
    run = asyncio.run(run_benchmark(gen, workload="custom", db_url=db))
    canceller.join()
    assert run.status == "cancelled" and run.storage_error is None
    assert run.name == "custom all-at-once"
    stored = runs.get_run(db, run.run_id, with_requests=True)
    assert stored["status"] == "cancelled"
    assert [r["error_kind"] for r in stored["requests"]] == ["cancelled"] * 3


def test_run_benchmark_without_a_store_and_a_failing_progress_callback(fake, db):
    url, _ = fake
    run = asyncio.run(run_benchmark(LoadGenerator([BenchRequest("x", None, 2)], base_url=url),
                                    workload="w"))
    assert run.db_url is None and run.as_dict()["stored"] is False

    def broken(progress):
        if progress.done:
            raise RuntimeError("progress display broke")

    gen = LoadGenerator([BenchRequest("x", None, 2)], base_url=url, progress=broken)
    with pytest.raises(RuntimeError, match="progress display broke"):
        asyncio.run(run_benchmark(gen, workload="w", db_url=db, run_id="r-1"))
    assert runs.get_run(db, "r-1")["status"] == "failed"
    with pytest.raises(BenchError, match="no requests"):
        LoadGenerator([])


def test_tokenizer_workloads_end_to_end(fake, db, capsys):
    url, state = fake
    assert bench_main(parse("--base-url", url, "--db", db, "--json", "--workload", "sharegpt",
                            "-n", "3", "--seed", "4")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "sharegpt n=3 seed=4" and report["summary"]["completed"] == 3
    assert all(isinstance(b["prompt"], str) for b in state.bodies)  # text: ShareGPT has no ids

    state.bodies.clear()
    assert bench_main(parse("--base-url", url, "--db", db, "--json", "--workload",
                            "long-prompt-burst", "-n", "5", "--long-prompt-len", "300")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["arrival"]["mode"] == "workload"
    assert sorted(len(b["prompt"]) for b in state.bodies)[-1] == 300  # the long one, as ids


def test_multi_turn_workload_end_to_end(fake, db, capsys):
    url, state = fake
    code = bench_main(parse("--base-url", url, "--db", db, "--json", "--workload", "multi-turn",
                            "--conversations", "2", "--max-turns", "2", "--max-turn-tokens", "12",
                            "--turn-output-len", "3", "--rate", "50", "--seed", "5"))
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["workload"] == "multi-turn conversations=2 max_turns=2 turn_tokens=12 output_len=3 seed=5"
    assert report["arrival"]["mode"] == "poisson"  # the conversations' starts
    assert report["summary"]["num_requests"] == report["summary"]["completed"] == 4  # 2 x 2 turns
    stored = runs.get_run(db, report["run_id"], with_requests=True)
    assert stored["status"] == "completed" and [r["index"] for r in stored["requests"]] == [0, 1, 2, 3]
    assert all(b["max_tokens"] == 3 and b["messages"][-1]["role"] == "user" for b in state.bodies)
    assert sorted(len(b["messages"]) for b in state.bodies) == [1, 1, 3, 3]


def test_multi_turn_option_errors_name_the_value(db, capsys):
    for flag in ("--max-turns", "--conversations", "--max-turn-tokens", "--turn-output-len"):
        with pytest.raises(SystemExit):
            parse("--workload", "multi-turn", flag, "0")
        err = capsys.readouterr().err
        assert f"argument {flag}: must be a positive integer, got 0" in err
    assert bench_main(parse("--workload", "multi-turn", "-n", "5")) == 2
    assert "--num-requests 5: multi-turn sends every turn of --conversations" in capsys.readouterr().err
    assert bench_main(parse("--workload", "skewed", "--conversations", "3")) == 2
    assert "--conversations 3 is only used with --workload multi-turn" in capsys.readouterr().err
