"""The load generator against a real HTTP server on 127.0.0.1 (a tiny OpenAI-shaped stub).

The stub only exercises the client's own logic: SSE parsing, timing, error kinds, arrival
modes, duration limit and cancellation.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import threading
import time

import pytest

from appliance.bench.loadgen import (
    BenchError,
    LoadGenerator,
    Progress,
    arrival_offsets,
    environment_proxy,
    iter_sse_data,
    normalize_base_url,
)
from appliance.bench.metrics import parse_slo
from appliance.bench.workloads import BenchRequest, Conversation, long_prompt_burst
from bench_fake_server import FakeState, serve


@pytest.fixture
def fake():
    state = FakeState()
    with serve(state) as url:
        yield url, state


def text_requests(n: int, output_len: int | None = 4, prompt: str = "hello there") -> list[BenchRequest]:
    return [BenchRequest(prompt, None, output_len) for _ in range(n)]


def run(gen: LoadGenerator, run_id: str | None = "run-1"):
    return asyncio.run(gen.run(run_id))


# ------------------------------------------------------------------------------- pure helpers


def test_iter_sse_data_handles_comments_multiline_and_missing_final_blank():
    lines = [": comment", "data: {\"a\": 1}", "", "event: x", "data:no-space", "data: second",
             "", "", "id: 7", "data: [DONE]"]

    async def collect():
        async def gen():
            for line in lines:
                yield line
        return [d async for d in iter_sse_data(gen())]

    assert asyncio.run(collect()) == ['{"a": 1}', "no-space\nsecond", "[DONE]"]


def test_poisson_offsets_are_seeded_and_have_the_requested_rate():
    reqs = text_requests(2000)
    a = arrival_offsets(reqs, 4.0, seed=1)
    assert a == arrival_offsets(reqs, 4.0, seed=1)
    assert a != arrival_offsets(reqs, 4.0, seed=2)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.1)
    # no rate: the workload's own offsets, else everything at once
    assert arrival_offsets(text_requests(3), None, 0) == [0.0, 0.0, 0.0]
    burst = long_prompt_burst(8, 0, num_long=2)
    assert arrival_offsets(burst, None, 0) == [r.arrival_offset for r in burst]


def test_base_url_normalisation_and_settings_are_checked():
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    with pytest.raises(BenchError, match="http://"):
        normalize_base_url("localhost:8000")
    with pytest.raises(BenchError, match="not both"):
        LoadGenerator(text_requests(1), rate=1.0, concurrency=2)
    with pytest.raises(BenchError, match="rate"):
        LoadGenerator(text_requests(1), rate=0)
    with pytest.raises(BenchError, match="no requests"):
        LoadGenerator([])


# ------------------------------------------------------------------------------ against HTTP


def test_streams_are_timed_and_bodies_carry_the_appliance_fields(fake):
    url, state = fake
    state.token_delay = 0.02
    state.history = [{"version": 1, "iteration": 0, "applied_at": 1.0, "old": {}, "new": {},
                      "source": "x"}]
    state.knob_change_on_request = True
    reqs = [BenchRequest("a b c", [5, 6, 7], 4, 3), BenchRequest(None, [1, 2], 3, 2)]
    gen = LoadGenerator(reqs, base_url=url + "/v1", slo=parse_slo("ttft=5s"))
    out = run(gen)

    assert out.appliance_server and out.model == "fake-model" and out.stopped is None
    assert out.knobs["knobs"] == {"max_num_seqs": 8}
    assert [c["version"] for c in out.knob_changes] == [2, 3]  # only changes inside the run
    for body in state.bodies:
        assert body["appliance_run_id"] == "run-1" and body["appliance_source"] == "loadtest"
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"]
        assert body["model"] == "fake-model"
    assert sorted(b["prompt"] for b in state.bodies) == [[1, 2], [5, 6, 7]]  # ids to our server

    first, second = out.results
    assert first.ok and first.error_kind is None and first.status == 200
    assert first.output_tokens == 4 and first.prompt_tokens == 3 and first.finish_reason == "length"
    assert first.server_request_id.startswith("cmpl-")
    # the server sleeps 20 ms between chunks: 3 gaps, the last chunk >= 60 ms after sending
    assert len(first.itl) == 3 and all(gap >= 0 for gap in first.itl) and sum(first.itl) > 0.03
    assert first.ttft + sum(first.itl) >= 0.059
    assert 0 < first.ttft < first.e2e
    assert first.e2e >= first.ttft + sum(first.itl) - 1e-6
    assert first.tpot == pytest.approx((first.e2e - first.ttft) / 3)
    assert second.ok and second.output_tokens == 3 and len(second.itl) == 2
    s = out.summary
    assert (s.completed, s.failed, s.not_sent, s.errors) == (2, 0, 0, {})
    assert s.total_output_tokens == 7 and s.total_input_tokens == 5
    assert s.itl.count == 5 and s.slo_met == 2 and s.output_len_mismatch == 0


def test_other_servers_get_text_and_no_extension_fields(fake):
    url, state = fake
    state.appliance = False
    state.usage = False
    reqs = [BenchRequest("some words here", [9, 9], 3, 2), BenchRequest(None, [4, 5], 2, 2),
            BenchRequest("free length", None, None)]
    out = run(LoadGenerator(reqs, base_url=url, concurrency=1))
    assert not out.appliance_server and out.knobs is None and out.knob_changes == []
    assert [b["prompt"] for b in state.bodies] == ["some words here", [4, 5], "free length"]
    assert not any(k.startswith("appliance_") for b in state.bodies for k in b)
    assert "max_tokens" not in state.bodies[2] and "ignore_eos" not in state.bodies[2]
    # without usage, the output length is the number of output chunks
    assert [r.output_tokens for r in out.results] == [3, 2, 16]
    assert all(r.prompt_tokens is None for r in out.results)


def test_streams_take_the_environments_proxy_once_as_httpx_does(monkeypatch):
    for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert environment_proxy("http://10.1.2.3:8000") is None
    monkeypatch.setenv("http_proxy", "http://proxy.example:3128")
    assert environment_proxy("http://10.1.2.3:8000") == "http://proxy.example:3128"
    monkeypatch.setenv("http_proxy", "proxy.example:3128")  # no scheme: http://, as httpx reads it
    assert environment_proxy("http://10.1.2.3:8000") == "http://proxy.example:3128"
    monkeypatch.setenv("no_proxy", "10.1.2.3,localhost")
    assert environment_proxy("http://10.1.2.3:8000") is None


def test_error_kinds(fake):
    url, state = fake
    prompts = ["http400", "http429", "http500", "drop", "error-event", "abort", "huge-line", "fine"]
    out = run(LoadGenerator([BenchRequest(p, None, 5) for p in prompts], base_url=url))
    kinds = {prompts[r.index]: r.error_kind for r in out.results}
    assert kinds == {"http400": "http_400", "http429": "http_429", "http500": "http_5xx",
                     "drop": "aborted", "error-event": "aborted", "abort": "aborted", "huge-line": "protocol",
                     "fine": None}
    by_prompt = {prompts[r.index]: r for r in out.results}
    assert by_prompt["http429"].error == "made-up 429" and by_prompt["http429"].status == 429
    assert by_prompt["error-event"].error == "engine failed"
    assert "line" in by_prompt["huge-line"].error.lower()
    assert out.summary.errors == {"aborted": 3, "http_400": 1, "http_429": 1, "http_5xx": 1, "protocol": 1}
    assert out.summary.completed == 1 and out.summary.failed == 7


def test_timeout_and_connection_errors(fake):
    url, _ = fake
    out = run(LoadGenerator([BenchRequest("hang", None, 2)], base_url=url, request_timeout_s=0.3))
    assert out.results[0].error_kind == "timeout"

    import socket
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(BenchError, match="cannot reach"):
        run(LoadGenerator(text_requests(1), base_url=closed))
    out = run(LoadGenerator(text_requests(2), base_url=closed, model="m", appliance_server=False))
    assert [r.error_kind for r in out.results] == ["connection", "connection"]


def test_api_key(fake):
    url, state = fake
    state.api_key = "sekrit"
    with pytest.raises(BenchError, match="API key"):
        run(LoadGenerator(text_requests(1), base_url=url))
    out = run(LoadGenerator(text_requests(1), base_url=url, api_key="sekrit"))
    assert out.summary.completed == 1


def test_fixed_concurrency_caps_requests_in_flight(fake):
    url, state = fake
    state.token_delay = 0.01
    out = run(LoadGenerator(text_requests(12, output_len=5), base_url=url, concurrency=3))
    assert out.summary.completed == 12
    assert state.max_in_flight == 3


def test_all_at_once_and_poisson_arrivals(fake):
    url, state = fake
    state.token_delay = 0.05
    run(LoadGenerator(text_requests(10, output_len=8), base_url=url))
    assert state.max_in_flight == 10

    state.bodies.clear()
    state.arrivals.clear()
    gen = LoadGenerator(text_requests(8, output_len=1), base_url=url, rate=10.0, seed=3)
    out = run(gen)
    expected = arrival_offsets(gen.requests, 10.0, 3)
    sent = [r.sent_at - out.results[0].sent_at for r in out.results]
    assert sent == pytest.approx(expected, abs=0.03)
    seen = [t - state.arrivals[0] for t in state.arrivals]  # as the server saw them
    assert seen == pytest.approx(expected, abs=0.08)


def test_workload_offsets_are_followed(fake):
    url, state = fake
    reqs = long_prompt_burst(6, 0, num_long=2, short_output_len=(2, 2), long_output_len=1,
                             short_window_s=0.1, long_start_s=0.4)
    out = run(LoadGenerator(reqs, base_url=url))
    sent = [r.sent_at - out.started_at for r in out.results]
    assert all(t < 0.3 for t in sent[:4]) and all(0.39 <= t < 0.6 for t in sent[4:])
    assert [len(b["prompt"]) for b in state.bodies[4:]] == [1024, 1024]


def test_duration_limit_cancels_outstanding_and_counts_unsent(fake):
    url, state = fake
    state.token_delay = 0.05
    gen = LoadGenerator(text_requests(10, output_len=200), base_url=url, rate=5.0, seed=0,
                        max_duration_s=0.5)
    t0 = time.perf_counter()
    out = run(gen)
    assert time.perf_counter() - t0 < 3
    s = out.summary
    assert out.stopped == "duration"
    assert s.completed == 0 and s.sent >= 1 and s.not_sent == 10 - s.sent
    assert s.errors == {"cancelled": s.sent}
    assert 0.45 < s.duration_s < 1.5
    deadline = time.monotonic() + 3
    while state.cancelled < s.sent and time.monotonic() < deadline:
        time.sleep(0.02)
    assert state.cancelled == s.sent  # the server saw the streams dropped


def test_cancel_from_another_thread_and_before_start(fake):
    url, state = fake
    state.token_delay = 0.05
    gen = LoadGenerator(text_requests(4, output_len=200), base_url=url)  # 10 s of streaming each

    def cancel_once_all_stream() -> None:
        deadline = time.monotonic() + 10
        while state.in_flight < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        gen.cancel()

    canceller = threading.Thread(target=cancel_once_all_stream)
    canceller.start()
    out = run(gen)
    canceller.join()
    assert out.stopped == "cancelled" and out.summary.errors == {"cancelled": 4}
    assert out.summary.duration_s < 5

    early = LoadGenerator(text_requests(3), base_url=url)
    early.cancel()
    out = run(early)
    assert out.stopped == "cancelled" and out.summary.sent == 0 and out.summary.not_sent == 3


def test_progress_callback_sees_every_request(fake):
    url, _ = fake
    seen: list[Progress] = []
    run(LoadGenerator(text_requests(5, output_len=2), base_url=url, concurrency=2,
                      progress=seen.append))
    assert seen[0].done == 0 and seen[0].total == 5
    assert [p.done for p in seen[1:]] == [1, 2, 3, 4, 5]
    last = seen[-1]
    assert last.ok == 5 and last.failed == 0 and last.in_flight == 0
    assert last.output_tokens == 10 and last.output_throughput > 0


def test_the_heap_alive_before_a_run_is_frozen_while_it_is_timed_and_given_back_after(fake):
    url, _ = fake
    assert gc.get_freeze_count() == 0, "this test process froze its heap before the test"
    during: list[int] = []
    run(LoadGenerator(text_requests(3, output_len=2), base_url=url,
                      progress=lambda p: during.append(gc.get_freeze_count())))
    assert len(during) == 4 and min(during) > 0  # the run's start and each finished request
    assert gc.get_freeze_count() == 0
    # a process that froze its own heap (as `appliance serve` does) keeps it frozen, and what it
    # made after that (1000 lists) is not frozen by the run; frozen objects freed by reference
    # counting leave the count
    gc.freeze()
    try:
        frozen, young = gc.get_freeze_count(), [[] for _ in range(1000)]
        during.clear()
        run(LoadGenerator(text_requests(2, output_len=2), base_url=url,
                          progress=lambda p: during.append(gc.get_freeze_count())))
        assert len(during) == 3 and all(frozen - 1000 < n <= frozen for n in during + [gc.get_freeze_count()])
        assert len(young) == 1000
    finally:
        gc.unfreeze()


# ------------------------------------------------------------------------- closed loops (chat)


def test_conversations_are_closed_loops_carrying_each_answer_as_returned(fake):
    url, state = fake
    convs = [Conversation(("a1", "a2", "a3"), 3), Conversation(("b1", "b2"), 2), Conversation(("c1",), 4)]
    gen = LoadGenerator(convs, base_url=url)
    out = run(gen)
    s = out.summary
    assert out.stopped is None and s.num_requests == s.completed == len(out.results) == 6 and s.not_sent == 0
    assert [r.index for r in out.results] == list(range(6))  # a conversation's turns are consecutive
    assert gen.arrival["mode"] == "all-at-once"
    assert all("messages" in b and "prompt" not in b and b["appliance_run_id"] == "run-1" for b in state.bodies)
    turns = {0: (0, 1, 2), 1: (3, 4), 2: (5,)}
    for k, indexes in turns.items():
        for n, i in enumerate(indexes):
            result, sent = out.results[i], out.requests[i]
            # the reply as the server streamed it (the role chunk is no token)
            assert result.text == "".join(f" {result.server_request_id}:{j}" for j in range(convs[k].output_len))
            assert len(result.itl) == result.output_tokens - 1
            assert sent.messages[-1] == {"role": "user", "content": convs[k].user_turns[n]}
            if n:  # the previous turn's history, its answer as returned, then the next user turn
                before = out.results[i - 1]
                assert sent.messages[:-1] == (*out.requests[i - 1].messages,
                                              {"role": "assistant", "content": before.text})
    # the server got each later turn only with the earlier answer in it
    for body in state.bodies:
        answers = [m["content"] for m in body["messages"] if m["role"] == "assistant"]
        assert len(answers) == len(body["messages"]) // 2


def test_a_failed_turn_ends_its_conversation_and_the_rest_is_not_sent(fake):
    url, state = fake
    convs = [Conversation(("hi", "http500", "never sent"), 2), Conversation(("x", "y"), 2)]
    out = run(LoadGenerator(convs, base_url=url))
    s = out.summary
    assert out.stopped is None
    assert (s.num_requests, s.sent, s.completed, s.failed, s.not_sent) == (5, 4, 3, 1, 1)
    assert s.errors == {"http_5xx": 1}
    assert [r.index for r in out.results] == [0, 1, 3, 4]
    assert not any(m["content"] == "never sent" for b in state.bodies for m in b["messages"])


def test_concurrency_counts_conversations_in_flight(fake):
    url, state = fake
    state.token_delay = 0.005
    convs = [Conversation((f"q{k}-1", f"q{k}-2", f"q{k}-3"), 3) for k in range(5)]
    gen = LoadGenerator(convs, base_url=url, concurrency=2)
    seen: list[Progress] = []
    gen.progress = seen.append
    out = run(gen)
    assert out.summary.completed == 15 and state.max_in_flight <= 2
    assert seen[0].total == 15 and seen[-1].done == 15
