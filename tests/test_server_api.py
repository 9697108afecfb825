"""The OpenAI-compatible API, admin routes and metrics of a real server (real model, 127.0.0.1),
driven with the official `openai` client and raw httpx for malformed input."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from appliance.engine.chat import encode_chat

MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=120) as c:
        yield c


@pytest.fixture
def restore_knobs(http):
    """Put the session server's knobs back after a test that changes them."""
    original = http.get("/admin/knobs").json()["knobs"]
    yield original
    current = http.get("/admin/knobs").json()["knobs"]
    if current != original:
        # two steps: the intermediate set must validate too (budget >= seqs, chunk <= budget)
        assert http.patch("/admin/knobs", json={"max_num_batched_tokens": 4096}).status_code == 200
        assert http.patch("/admin/knobs", json=original).status_code == 200


def tokenizer(loaded_model):
    return loaded_model.tokenizer


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body


def wait_idle(http: httpx.Client, timeout: float = 15.0) -> dict:
    """Poll /admin/state until nothing runs or waits, every KV block is free and no response is
    still being written (the event loop closes a stream after the engine let go of it)."""
    deadline = time.monotonic() + timeout
    while True:
        state = http.get("/admin/state").json()
        if (state["running"], state["waiting"], state["kv_blocks_used"], state["in_flight"]) == (0, 0, 0, 0):
            return state
        assert time.monotonic() < deadline, f"engine not idle: {state}"
        time.sleep(0.05)


def metric_values(text: str) -> dict[tuple[str, tuple], float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


# -- happy paths --------------------------------------------------------------------------------
def test_models_and_health(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert http.get("/health").json() == {"status": "ok"}


def test_chat_completion_and_stream_agree(client, loaded_model):
    messages = [{"role": "user", "content": "Name a colour. <|im_start|>system"}]
    prompt_tokens = len(encode_chat(tokenizer(loaded_model), messages))
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion" and full.model == MODEL
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        prompt_tokens, 6, prompt_tokens + 6)

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    pieces = [c.choices[0].delta.content for c in content if c.choices[0].delta.content]
    assert 1 <= len(pieces) <= 6
    assert "".join(pieces) == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == prompt_tokens


def test_completion_text_token_ids_and_stream(client, loaded_model):
    prompt = "The capital of France is"
    ids = tokenizer(loaded_model).encode(prompt, add_special_tokens=False)
    answers = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
               for p in (prompt, ids, [prompt], [ids])]
    assert answers[0].id.startswith("cmpl-") and answers[0].object == "text_completion"
    assert len({a.choices[0].text for a in answers}) == 1
    assert {a.usage.prompt_tokens for a in answers} == {len(ids)}
    assert all(a.usage.completion_tokens <= 5 for a in answers)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == answers[0].choices[0].text
    assert chunks[-1].choices[0].finish_reason == answers[0].choices[0].finish_reason


def test_stop_strings_cut_the_text(client):
    kwargs = dict(model=MODEL, prompt="Count: 1, 2, 3, 4,", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    text = client.completions.create(**kwargs).choices[0].text
    start = len(text) // 2
    stop = text[start:start + 2]
    assert stop.strip(), text
    expected = text[: text.find(stop)]
    for stop_arg in (stop, [stop, "never-generated-zzz"]):
        cut = client.completions.create(**{**kwargs, "stop": stop_arg}).choices[0]
        assert (cut.text, cut.finish_reason) == (expected, "stop")
    streamed = list(client.completions.create(**{**kwargs, "stop": [stop]}, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=1234)
    first, second = (client.completions.create(**kwargs).choices[0].text for _ in range(2))
    assert first == second


def test_extreme_but_valid_sampling_values(http):
    """Regression: a tiny temperature or top_p once made the sampler raise and stopped the engine."""
    for extreme in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 5e-324}, {"temperature": 100, "top_k": 1}):
        response = http.post(COMP, json=comp_body(max_tokens=2, **extreme))
        assert response.status_code == 200, (extreme, response.text)
    assert http.get("/health").status_code == 200


def test_default_valued_fields_are_accepted_unknown_ones_refused(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 1, "n": 1, "user": "u1", "presence_penalty": 0, "logprobs": False,
            "appliance_source": "loadtest", "appliance_run_id": "run-1"}
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == response.json()["id"]
    refused = http.post(CHAT, json={**body, "max_token": 5})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "max_token" and "Unrecognized request argument" in error["message"]


# -- errors -------------------------------------------------------------------------------------
def chat_body(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **kw}


def comp_body(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 1, **kw}


BAD_BODIES = [
    (CHAT, b'{"model": ', "malformed"),
    (CHAT, b"", "malformed"),
    (CHAT, b'\xff\xfe{"a": 1}', "UTF-8"),
    (CHAT, b"[1, 2]", "object"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN"),
    (COMP, b'{"prompt": "hi", "temperature": Infinity}', "Infinity"),
    (COMP, b'{"prompt": "hi", "temperature": 1e999}', "finite"),
    (COMP, b'{"prompt": "hi", "x": ' + b"[" * 100 + b"]" * 100 + b"}", "nested"),
    (COMP, b'{"prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested"),
    (COMP, b'{"prompt": "\\ud800 lone surrogate"}', "Unicode"),
    (COMP, b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", "malformed"),
]


@pytest.mark.parametrize("path,raw,words", BAD_BODIES)
def test_malformed_bodies_get_400(http, path, raw, words):
    body = assert_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
    assert words.lower() in body["error"]["message"].lower()


BAD_PARAMS = [
    (CHAT, chat_body(max_tokens=True), "max_tokens"),
    (CHAT, chat_body(max_tokens=2.0), "max_tokens"),
    (CHAT, chat_body(max_tokens=0), "max_tokens"),
    (CHAT, chat_body(max_completion_tokens=-1), "max_tokens"),
    (CHAT, chat_body(max_completion_tokens="3"), "max_completion_tokens"),
    (CHAT, chat_body(max_completion_tokens=2, max_tokens=10**6), "max_tokens"),
    (CHAT, chat_body(temperature="1"), "temperature"),
    (CHAT, chat_body(temperature=-0.5), "temperature"),
    (CHAT, chat_body(top_p=0), "top_p"),
    (CHAT, chat_body(top_k=-2), "top_k"),
    (CHAT, chat_body(seed=1.5), "seed"),
    (CHAT, chat_body(n=2), "n"),
    (CHAT, chat_body(n=False), "n"),
    (CHAT, chat_body(stream="yes"), "stream"),
    (CHAT, chat_body(stream_options="include_usage"), "stream_options"),
    (CHAT, chat_body(stream_options={"include_usage": 1}), "stream_options.include_usage"),
    (CHAT, chat_body(stream=True, stream_options=[1]), "stream_options"),
    (CHAT, chat_body(stop=""), "stop"),
    (CHAT, chat_body(stop=["a"] * 17), "stop"),
    (CHAT, chat_body(stop=[1]), "stop"),
    (CHAT, chat_body(ignore_eos=1), "ignore_eos"),
    (CHAT, chat_body(min_tokens=5), "min_tokens"),
    (CHAT, chat_body(presence_penalty=0.5), "presence_penalty"),
    (CHAT, chat_body(logprobs=True), "logprobs"),
    (CHAT, chat_body(appliance_source="bench"), "appliance_source"),
    (CHAT, chat_body(appliance_run_id="x" * 37), "appliance_run_id"),
    (CHAT, {"model": MODEL, "max_tokens": 1}, "messages"),
    (CHAT, chat_body(messages=[]), "messages"),
    (CHAT, chat_body(messages="hi"), "messages"),
    (CHAT, chat_body(messages=[{"role": "tool", "content": "x"}]), "messages"),
    (CHAT, chat_body(messages=[{"role": "user", "content": 5}]), "messages"),
    (CHAT, chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
    (CHAT, chat_body(model=5), "model"),
    (COMP, comp_body(prompt=["a", "b"]), "prompt"),
    (COMP, comp_body(prompt=[[1, 2], [3]]), "prompt"),
    (COMP, comp_body(prompt=""), "prompt"),
    (COMP, comp_body(prompt=[]), "prompt"),
    (COMP, comp_body(prompt=None), "prompt"),
    (COMP, comp_body(prompt=[1, True]), "prompt"),
    (COMP, comp_body(prompt=[1, 10**9]), "prompt"),
    (COMP, comp_body(prompt=[-1]), "prompt"),
    (COMP, comp_body(prompt={"text": "hi"}), "prompt"),
    (COMP, comp_body(echo=True), "echo"),
    (COMP, comp_body(best_of=2), "best_of"),
    (COMP, comp_body(stop_token_ids=[10**9]), "stop_token_ids"),
]


@pytest.mark.parametrize("path,body,param", BAD_PARAMS)
def test_invalid_parameters_get_400_naming_the_field(http, path, body, param):
    assert_error(http.post(path, json=body), 400, param=param)


REFUSAL_CODES = [
    (CHAT, chat_body(max_tokens="3"), "max_tokens", "invalid_type"),
    (CHAT, chat_body(temperature=-1), "temperature", "invalid_value"),
    (CHAT, {"model": MODEL}, "messages", "missing_required_parameter"),
    (CHAT, chat_body(presence_penalty=0.5), "presence_penalty", "unsupported_parameter"),
    (CHAT, chat_body(max_token=5, zz=1), "max_token", "unrecognized_argument"),
    (COMP, comp_body(min_tokens=2), "min_tokens", "invalid_value"),  # checked by the engine
]


@pytest.mark.parametrize("path,body,param,code", REFUSAL_CODES)
def test_refusals_carry_a_code(http, path, body, param, code):
    assert_error(http.post(path, json=body), 400, param=param, code=code)


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3)
    assert bad.value.status_code == 400 and bad.value.param == "n"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=1)
    assert missing.value.code == "model_not_found" and "gpt-9" in missing.value.message


def test_prompt_over_context_length(http, loaded_model):
    token = tokenizer(loaded_model).encode("hello", add_special_tokens=False)[0]
    body = assert_error(http.post(COMP, json=comp_body(prompt=[token] * 4000, max_tokens=200)), 400,
                        code="context_length_exceeded")
    assert "4096" in body["error"]["message"] and "4200" in body["error"]["message"]
    # a long text prompt (tokenised off the event loop) with the default max_tokens
    text = "hello " * 5000
    n = len(encode_chat(tokenizer(loaded_model), [{"role": "user", "content": text}]))
    response = http.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": text}]})
    body = assert_error(response, 400, code="context_length_exceeded")
    assert "4096" in body["error"]["message"] and str(n) in body["error"]["message"]


def test_oversized_bodies_get_413(http):
    big = json.dumps(comp_body(prompt="x" * (1 << 20))).encode()
    assert_error(http.post(COMP, content=big), 413, code="request_too_large")

    def chunked():
        for _ in range(24):
            yield b" " * 65536  # JSON whitespace: only the size is wrong

    assert_error(http.post(COMP, content=chunked()), 413, code="request_too_large")


def test_wrong_routes_and_methods_use_the_error_shape(http):
    assert_error(http.get("/v1/nothing-here"), 404, code="not_found")
    assert_error(http.get(COMP), 405, code="method_not_allowed")
    assert_error(http.delete("/admin/knobs"), 405)
    assert_error(http.post("/health"), 405)


def test_model_fault_ends_with_error(server_factory, monkeypatch):
    with server_factory(num_blocks=64) as srv:
        def broken(*args, **kwargs):
            raise RuntimeError("injected fault")

        monkeypatch.setattr(srv.state.engine.runner, "execute", broken)
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            assert_error(c.post(COMP, json=comp_body(max_tokens=4)), 503, code="engine_error")
            response = c.post(COMP, json=comp_body(max_tokens=4, stream=True))
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "engine_error"
            assert json.loads(events[-3])["choices"][0]["finish_reason"] == "error"
            client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.APIError):
                list(client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True))
            monkeypatch.undo()
            ok = c.post(COMP, json=comp_body(max_tokens=2))
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
            assert wait_idle(c)["kv_blocks_used"] == 0


def test_queue_full_gets_429(server_factory):
    with server_factory(num_blocks=64, max_waiting=1, max_num_seqs=1) as srv:
        async def scenario():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as c:
                long = comp_body(max_tokens=400, ignore_eos=True, stream=True)

                async def stream_until_first_chunk(started: asyncio.Event):
                    async with c.stream("POST", COMP, json=long) as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data: "):
                                started.set()
                        await asyncio.sleep(3600)

                running, waiting = asyncio.Event(), asyncio.Event()
                first = asyncio.create_task(stream_until_first_chunk(running))
                await asyncio.wait_for(running.wait(), 60)
                second = asyncio.create_task(stream_until_first_chunk(waiting))
                for _ in range(400):
                    if (await c.get("/admin/state")).json()["waiting"] == 1:
                        break
                    await asyncio.sleep(0.05)
                response = await c.post(COMP, json=comp_body())
                assert_error(response, 429, code="queue_full")
                assert response.headers["retry-after"]
                for task in (second, first):  # disconnecting aborts a waiting and a running request
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)

        asyncio.run(scenario())
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            wait_idle(c)
            assert c.post(COMP, json=comp_body()).status_code == 200


# -- disconnects ----------------------------------------------------------------------------------
def test_disconnect_mid_stream_aborts_and_frees_blocks(live_server, http):
    wait_idle(http)
    aborted = ("appliance:request_success_total", (("finished_reason", "abort"),))
    before = metric_values(http.get("/metrics").text)[aborted]
    with httpx.Client(base_url=live_server.base_url, timeout=60) as c:
        with c.stream("POST", COMP, json=comp_body(prompt="Tell me a story", max_tokens=1000, ignore_eos=True,
                                                   stream=True)) as response:
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break
            state = http.get("/admin/state").json()
            assert state["running"] == 1 and state["kv_blocks_used"] > 0
    state = wait_idle(http, timeout=10)
    assert state["in_flight"] == 0
    assert metric_values(http.get("/metrics").text)[aborted] == before + 1


def test_disconnect_while_waiting_for_a_non_streaming_reply_aborts(live_server, http):
    wait_idle(http)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live_server.base_url}{COMP}", json=comp_body(max_tokens=1000, ignore_eos=True), timeout=1.0)
    wait_idle(http, timeout=10)


# -- knobs ----------------------------------------------------------------------------------------
def test_concurrent_streams_while_knobs_change(live_server, http, restore_knobs):
    changes = [
        ({"max_num_seqs": 4}, "admin"),
        ({"max_num_seqs": 16, "max_num_batched_tokens": 256}, "dashboard"),
        ({"scheduling_policy": "static"}, "admin"),
        ({"scheduling_policy": "continuous", "max_num_seqs": 8, "long_prefill_token_threshold": 64}, "dashboard"),
        ({"max_num_seqs": 32}, "admin"),
    ]
    before = http.get("/admin/knobs").json()
    n_tokens = 8

    async def scenario():
        client = openai.AsyncOpenAI(base_url=f"{live_server.base_url}/v1", api_key="x", max_retries=0, timeout=300)

        async def one(i: int):
            stream = await client.completions.create(
                model=MODEL, prompt=f"Request number {i}:", max_tokens=n_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            finish, usage, text = None, None, ""
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage
            return finish, usage.completion_tokens, text

        async def turn_knobs():
            applied = []
            async with httpx.AsyncClient(base_url=live_server.base_url, timeout=60) as c:
                for change, source in changes:
                    await asyncio.sleep(0.25)
                    headers = {"X-Appliance-Source": source} if source != "admin" else {}
                    response = await c.patch("/admin/knobs", json=change, headers=headers)
                    assert response.status_code == 200, response.text
                    body = response.json()
                    assert all(body["knobs"][k] == v for k, v in change.items())
                    applied.append(body)
            return applied

        results = await asyncio.gather(*(one(i) for i in range(32)), turn_knobs())
        await client.close()
        return results[:-1], results[-1]

    streams, applied = asyncio.run(scenario())
    assert [(finish, tokens) for finish, tokens, _ in streams] == [("length", n_tokens)] * 32
    assert all(text for _, _, text in streams)
    assert [a["version"] for a in applied] == list(range(before["version"] + 1, before["version"] + 6))
    history = http.get("/admin/knobs/history").json()["data"]
    ours = [h for h in history if h["version"] > before["version"]]
    assert [h["version"] for h in ours] == [a["version"] for a in applied]
    assert [h["source"] for h in ours] == [source for _, source in changes]
    assert [h["iteration"] for h in ours] == [a["iteration"] for a in applied]
    assert [h["iteration"] for h in ours] == sorted(h["iteration"] for h in ours)
    for entry, (change, _) in zip(ours, changes):
        assert {k: v for k, v in entry["new"].items()} == {
            k: v for k, v in change.items() if entry["old"].get(k) != v}
    wait_idle(http)


def test_patch_valid_knobs(http, restore_knobs):
    before = http.get("/admin/knobs").json()
    response = http.patch("/admin/knobs", json={"max_num_seqs": 12}, headers={"X-Appliance-Source": "dashboard"})
    assert response.status_code == 200
    body = response.json()
    assert body["knobs"]["max_num_seqs"] == 12 and body["version"] == before["version"] + 1
    assert body["iteration"] >= before["iteration"] and body["source"] == "dashboard"
    assert body["fixed"] == before["fixed"]
    after = http.get("/admin/knobs").json()
    assert after["knobs"] == body["knobs"] and after["version"] == body["version"]
    # the same values again change nothing and add no history
    again = http.patch("/admin/knobs", json={"max_num_seqs": 12}).json()
    assert again["version"] == body["version"]
    assert http.get("/admin/knobs/history").json()["data"][-1]["version"] == body["version"]


def test_patch_invalid_knobs_changes_nothing(http):
    before = http.get("/admin/knobs").json()
    history = http.get("/admin/knobs/history").json()["data"]
    bad = {"max_num_seqs": 0, "max_num_batched_tokens": "many", "scheduling_policy": "fifo",
           "max_num_partial_prefills": True, "bogus": 1}
    body = assert_error(http.patch("/admin/knobs", json=bad), 422, code="invalid_knobs")
    assert set(body["errors"]) == set(bad)
    assert all(name in body["error"]["message"] for name in bad)
    body = assert_error(http.patch("/admin/knobs", json={"max_num_seqs": 2048}), 422)  # > max_num_batched_tokens
    assert set(body["errors"]) == {"max_num_seqs"}
    for not_an_object in (b"[1]", b'"x"', b"3", b"null"):
        assert_error(http.patch("/admin/knobs", content=not_an_object), 422)
    assert_error(http.patch("/admin/knobs", content=b"{oops"), 400)
    assert_error(http.patch("/admin/knobs", json={"max_num_seqs": 8}, headers={"X-Appliance-Source": "Bad Source!"}),
                 400)
    after = http.get("/admin/knobs").json()
    assert (after["knobs"], after["version"]) == (before["knobs"], before["version"])
    assert http.get("/admin/knobs/history").json()["data"] == history


def test_admin_views(http, live_server):
    knobs = http.get("/admin/knobs").json()
    assert set(knobs) >= {"knobs", "version", "iteration", "fixed"}
    assert knobs["fixed"] == {"block_size": 16, "num_blocks": 256, "kv_cache_tokens": 4096, "max_model_len": 4096,
                              "model": MODEL, "device": "cpu", "dtype": "float32",
                              "cpu_kernels": live_server.state.engine.cpu_kernels, "threads": torch.get_num_threads()}
    state = http.get("/admin/state").json()
    assert state["kv_blocks_total"] == 256 and state["replica_id"] == "test" and state["model"] == MODEL
    assert state["telemetry_rows_dropped"] == 0 and state["uptime_s"] > 0
    schema = http.get("/openapi.json").json()
    assert set(schema["paths"]) >= {CHAT, COMP, "/v1/models", "/admin/knobs", "/admin/knobs/history", "/admin/state",
                                    "/admin/simulate", "/admin/autopilot", "/health", "/metrics"}
    import schemathesis

    operations = [op.ok() for op in schemathesis.openapi.from_dict(schema).get_all_operations()]
    assert len(operations) == 12


# -- metrics --------------------------------------------------------------------------------------
def test_metrics_count_what_was_sent(client, http, loaded_model):
    wait_idle(http)
    before = metric_values(http.get("/metrics").text)
    prompts = ["Hello there", "A B C D", "One more prompt here"]
    for prompt in prompts:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    list(client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=4, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True}))
    wait_idle(http)
    after = metric_values(http.get("/metrics").text)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    tok = tokenizer(loaded_model)
    prompt_tokens = sum(len(tok.encode(p, add_special_tokens=False)) for p in prompts + prompts[:1])
    assert delta("appliance:prompt_tokens_total") == prompt_tokens
    assert delta("appliance:generation_tokens_total") == 16
    assert delta("appliance:request_success_total", finished_reason="length") == 4
    assert delta("appliance:request_success_total", finished_reason="abort") == 0
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"appliance:{histogram}_count") == 4
    assert delta("appliance:inter_token_latency_seconds_count") == 4 * 3
    assert delta("appliance:iteration_tokens_total_count") >= 4
    assert delta("appliance:iteration_tokens_total_sum") >= prompt_tokens + 16 - 4

    knobs = http.get("/admin/knobs").json()["knobs"]
    for name, value in knobs.items():
        if isinstance(value, str):
            assert after[(f"appliance:knob_{name}", ((name, value),))] == 1
        else:
            assert after[(f"appliance:knob_{name}", ())] == value
    assert after[("appliance:num_requests_running", ())] == 0
    assert after[("appliance:num_requests_waiting", ())] == 0
    assert after[("appliance:kv_cache_usage_perc", ())] == 0
    assert after[("appliance:num_preemptions_total", ())] >= 0
    assert after[("appliance:telemetry_rows_dropped_total", ())] == 0


# -- prefix caching ---------------------------------------------------------------------------------
def test_prefix_cache_usage_and_counters(client, http, restore_knobs):
    wait_idle(http)
    before = metric_values(http.get("/metrics").text)
    messages = [{"role": "system", "content": "You answer questions about the solar system in one short sentence, "
                                              "naming the planet first and never guessing numbers you do not know."},
                {"role": "user", "content": "Which planet has the largest moon?"}]
    answers = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
               for _ in range(2)]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < answers[1].usage.prompt_tokens_details.cached_tokens < answers[1].usage.prompt_tokens
    streamed = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert streamed == answers[1].usage.prompt_tokens_details.cached_tokens
    assert http.patch("/admin/knobs", json={"enable_prefix_caching": False}).status_code == 200
    raw = http.post(CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0}).json()
    assert raw["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    wait_idle(http)
    after = metric_values(http.get("/metrics").text)

    def delta(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0.0)

    usages = [a.usage for a in answers] + [chunks[-1].usage]
    assert delta("appliance:prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages) + raw["usage"][
        "prompt_tokens"]
    assert delta("appliance:prefix_cache_hits_total") == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert after[("appliance:knob_enable_prefix_caching", ())] == 0
