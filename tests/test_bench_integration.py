"""The load generator against the REAL appliance server: every workload and arrival mode runs,
is stored, and agrees with the server's own `requests` rows (joined by run id and request id);
multi-turn conversations carry the model's answers and hit the prefix cache (not with it off)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import pytest
from sqlalchemy import select

from appliance.bench.loadgen import LoadGenerator
from appliance.bench.metrics import percentile
from appliance.bench.runner import run_benchmark
from appliance.bench.workloads import jsonl, long_prompt_burst, multi_turn, sharegpt, skewed
from appliance.telemetry import queries, runs
from appliance.telemetry.models import Request
from appliance.telemetry.store import using_engine
from bench_live_server import REPLICA, telemetry_server

MAX_OUTPUT = 6
CLOCK_SLACK_S = 0.05  # the server's clock starts after the client's; allow rounding between them


@pytest.fixture(scope="module")
def server(server_factory, tmp_path_factory):
    db = f"sqlite:///{tmp_path_factory.mktemp('bench-integration') / 'telemetry.db'}"
    with telemetry_server(server_factory, db) as srv:
        srv.db = db
        yield srv


def short(requests):
    return [dataclasses.replace(r, output_len=min(r.output_len, MAX_OUTPUT)) for r in requests]


def workload(kind, loaded_model, tmp_path):
    tok = loaded_model.tokenizer
    if kind == "skewed":
        return short(skewed(4, seed=3))
    if kind == "sharegpt":
        count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
        return short(sharegpt(4, 0, count, max_prompt_len=96, max_total_len=160))
    if kind == "long-prompt-burst":
        return long_prompt_burst(5, 0, num_long=1, long_prompt_len=96, long_output_len=3,
                                 short_prompt_len=(8, 16), short_output_len=(3, MAX_OUTPUT),
                                 short_window_s=0.2, long_start_s=0.3)
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(o) for o in [
        {"prompt": "The capital of France is", "output_len": 4},
        {"prompt_ids": tok.encode("Once upon a time", add_special_tokens=False), "max_tokens": 5},
        {"prompt": "List three colours:", "output_len": 3},
        {"prompt": "2 + 2 =", "max_tokens": 2},
    ]) + "\n")
    return jsonl(path)


CASES = [  # each workload once, each arrival mode at least once
    ("skewed", {}, "all-at-once"),
    ("sharegpt", {"rate": 8.0}, "poisson"),
    ("long-prompt-burst", {}, "workload"),
    ("jsonl", {"concurrency": 2}, "concurrency"),
]


@pytest.mark.parametrize("kind, arrival, mode", CASES, ids=[c[0] for c in CASES])
def test_run_agrees_with_server_rows(server, loaded_model, tmp_path, kind, arrival, mode):
    requests = workload(kind, loaded_model, tmp_path)
    generator = LoadGenerator(requests, base_url=server.base_url, seed=1, **arrival)
    run = asyncio.run(run_benchmark(generator, workload=kind, db_url=server.db))
    assert run.storage_error is None and run.status == "completed"
    assert server.writer.flush(10)

    stored = runs.get_run(server.db, run.run_id, with_requests=True)
    assert stored["arrival"]["mode"] == mode and stored["replica_id"] == REPLICA
    client = stored["requests"]
    with using_engine(server.db) as engine, engine.connect() as conn:
        req = Request.__table__
        server_rows = {r.request_id: r for r in conn.execute(select(req).where(req.c.run_id == run.run_id))}
    # request count: every request sent is one client row and one server row, all ok
    assert len(client) == len(server_rows) == len(requests)
    assert all(r["ok"] for r in client)
    assert {r["request_id"] for r in client} == set(server_rows)
    for row in client:
        srv = server_rows[row["request_id"]]
        assert srv.source == "loadtest" and srv.finish_reason == "length"
        assert row["prompt_tokens"] == srv.prompt_tokens
        assert row["output_tokens"] == srv.output_tokens == requests[row["index"]].output_len
        if requests[row["index"]].prompt_len is not None:
            assert srv.prompt_tokens == requests[row["index"]].prompt_len
        # the server's timeline sits inside the client's
        assert srv.first_token - srv.arrival <= row["ttft_s"] + CLOCK_SLACK_S
        assert srv.finished - srv.arrival <= row["e2e_s"] + CLOCK_SLACK_S

    # token totals: stored summary == client rows == server rows
    summary = stored["summary"]["summary"]
    server_summary = queries.run_summary(server.db, run.run_id)
    assert summary["total_input_tokens"] == sum(r["prompt_tokens"] for r in client) == server_summary["prompt_tokens"]
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in client) == server_summary["output_tokens"]
    assert server_summary["requests"] == summary["completed"] == len(requests)
    assert server_summary["finish_reasons"] == {"length": len(requests)}
    assert summary["replicas"] == {REPLICA: len(requests)}  # one process: a fleet of one (X-Appliance-Replica)

    # percentiles: the stored ones are those of the stored rows; the server's are no larger
    for metric, column in (("ttft", "ttft_s"), ("e2e", "e2e_s")):
        values = [r[column] for r in client]
        for q in (50, 90, 99):
            assert summary[metric][f"p{q}"] == pytest.approx(percentile(values, q), abs=1e-9)
        server_dist = server_summary[f"{metric}_s"]
        for q in ("p50", "p90", "p99"):
            assert server_dist[q] <= summary[metric][q] + CLOCK_SLACK_S
    itl = [gap for r in client for gap in r["itl_s"]]
    assert summary["itl"]["count"] == len(itl) == sum(r["output_tokens"] - 1 for r in client)
    assert summary["itl"]["p99"] == pytest.approx(percentile(itl, 99), abs=1e-9)


def run_conversations(server, loaded_model, caching: bool):
    """3 ShareGPT conversations x 3 turns (short turns, 4-token answers), caching on or off."""
    tok = loaded_model.tokenizer
    cut = lambda text: tok.decode(tok.encode(text, add_special_tokens=False)[:24])  # noqa: E731
    convs = multi_turn(3, 7, cut, max_turns=3, output_len=4)
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        assert http.patch("/admin/knobs", json={"enable_prefix_caching": caching}).status_code == 200
        try:
            run = asyncio.run(run_benchmark(LoadGenerator(convs, base_url=server.base_url, concurrency=2),
                                            workload="multi-turn", db_url=server.db))
        finally:
            assert http.patch("/admin/knobs", json={"enable_prefix_caching": True}).status_code == 200
    assert run.storage_error is None and run.status == "completed"
    assert server.writer.flush(10)
    return convs, run


def server_rows(server, run_id):
    with using_engine(server.db) as engine, engine.connect() as conn:
        req = Request.__table__
        return {r.request_id: r for r in conn.execute(select(req).where(req.c.run_id == run_id))}


def test_multi_turn_conversations_carry_the_answers_and_hit_the_prefix_cache(server, loaded_model):
    convs, run = run_conversations(server, loaded_model, caching=True)
    load = run.load
    assert sum(c.max_requests for c in convs) == 9 == load.summary.num_requests == load.summary.completed
    stored = runs.get_run(server.db, run.run_id, with_requests=True)
    rows = server_rows(server, run.run_id)
    assert len(stored["requests"]) == len(rows) == 9 and all(r["ok"] for r in stored["requests"])
    assert {r["request_id"] for r in stored["requests"]} == set(rows)
    block_size = server.state.engine.block_manager.block_size
    for i, (result, sent) in enumerate(zip(load.results, load.requests)):
        turn = len(sent.messages) // 2
        srv = rows[result.server_request_id]
        assert srv.source == "loadtest" and srv.output_tokens == result.output_tokens == 4
        assert srv.cached_tokens == result.cached_tokens and result.text.strip()
        if turn:  # the history sent is the previous turn's, with its answer as the server returned it
            before, prev = load.results[i - 1], load.requests[i - 1]
            assert sent.messages[:-1] == (*prev.messages, {"role": "assistant", "content": before.text})
            # every full block of the previous prompt is served from the cache
            assert result.cached_tokens >= before.prompt_tokens // block_size * block_size > 0
            assert result.prompt_tokens > before.prompt_tokens + before.output_tokens
    assert stored["summary"]["summary"]["prefix_cache_hit_rate"] == pytest.approx(
        sum(r.cached_tokens for r in load.results) / sum(r.prompt_tokens for r in load.results))


def test_multi_turn_with_caching_off_serves_nothing_from_the_cache(server, loaded_model):
    _, run = run_conversations(server, loaded_model, caching=False)
    assert run.load.summary.completed == 9
    assert [r.cached_tokens for r in run.load.results] == [0] * 9
    assert all(row.cached_tokens == 0 for row in server_rows(server, run.run_id).values())
    assert run.load.summary.prefix_cache_hit_rate == 0
