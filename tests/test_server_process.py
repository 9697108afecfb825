"""`appliance serve` as a real process: flag validation, host refusal, API key, telemetry store
upgrade at start, and the SIGTERM drain."""

from __future__ import annotations

import re
import socket

import httpx
import openai
import pytest

from appliance.cli import main
from drain_check import DrainStreams, assert_refusing_while_draining

MODEL = "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("argv,words", [
    (["--port", "70000"], "70000"),
    (["--port", "0"], "--port"),
    (["--drain-grace-s", "-1"], "-1.0"),
    (["--drain-grace-s", "nan"], "nan"),
    (["--max-waiting", "0"], "--max-waiting"),
    (["--max-body-bytes", "lots"], "lots"),
    (["--replica-id", "r" * 65], "--replica-id"),
    (["--telemetry-retention", "sometimes"], "sometimes"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--num-blocks", "0"], "num_blocks"),
    (["--config", "no-such-preset"], "no-such-preset"),
])
def test_bad_settings_exit_2_naming_the_value(capsys, tmp_path, argv, words):
    assert main(["serve", "--db", f"sqlite:///{tmp_path}/t.db", *argv]) == 2
    err = capsys.readouterr().err
    assert "appliance serve: error:" in err and words in err


def test_port_in_use_fails_before_the_model_loads(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--no-telemetry", "--no-dashboard"]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "in use" in err


def test_public_host_without_key_is_refused(spawn_server):
    server = spawn_server("--host", "0.0.0.0", "--no-telemetry", ready=False)
    assert server.proc.wait(60) == 2
    log = server.log()
    assert "0.0.0.0" in log and "--api-key" in log and "--insecure" in log
    assert "KV cache" not in log  # refused before the model was loaded


def test_api_key_guards_v1_and_admin(spawn_server, tmp_path):
    from sqlalchemy import select

    from appliance.telemetry import runs, store
    from appliance.telemetry.models import Request

    db_url = f"sqlite:///{tmp_path}/telemetry.db"
    store.upgrade(db_url)
    stale = runs.create_run(db_url, "left over", "w", {"mode": "concurrency"}, {}, "replica-a")
    other = runs.create_run(db_url, "another replica's", "w", {"mode": "concurrency"}, {}, "replica-b")
    key = "s3cret-key-for-tests"
    server = spawn_server("--api-key", key, "--num-blocks", "256", "--db", db_url, "--replica-id", "replica-a",
                          "--no-dashboard")
    url = server.base_url
    for path in ("/v1/models", "/admin/knobs", "/admin/state", "/admin/knobs/history"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            response = httpx.get(url + path, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + path, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.patch(url + "/admin/knobs", json={"max_num_seqs": 4}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert reply.usage.completion_tokens <= 3

    assert runs.get_run(db_url, stale)["status"] == "interrupted"
    assert runs.get_run(db_url, other)["status"] == "running"
    server.terminate()
    assert server.proc.wait(60) == 0
    assert key not in server.log()
    # the writer was wired to the engine and flushed at shutdown
    db = store.make_engine(db_url)
    try:
        with db.connect() as conn:
            row = conn.execute(select(Request.__table__).where(Request.request_id == reply.id)).one()
    finally:
        db.dispose()
    assert (row.replica_id, row.source) == ("replica-a", "api")


def test_sigterm_drains_then_exits_0(spawn_server, tmp_path):
    server = spawn_server("--num-blocks", "256", "--drain-grace-s", "4", "--db", f"sqlite:///{tmp_path}/t.db",
                          "--no-dashboard")
    streams = DrainStreams(server.base_url)
    streams.start()
    server.terminate()
    assert_refusing_while_draining(server.base_url)
    streams.join()
    assert server.proc.wait(60) == 0
    for name, reason in (("short", "length"), ("long", "abort")):
        events = streams.events[name]
        assert events[-1] == {"done": True}, name
        assert events[-2]["choices"][0]["finish_reason"] == reason, name
    log = server.log()
    assert "drained (1 request(s) aborted)" in log
    frozen = re.search(r"heap frozen: (\d+) objects", log)  # the model's objects among them
    assert frozen is not None and int(frozen.group(1)) > 100_000
