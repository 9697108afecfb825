"""Faults with a live server: a telemetry store that is locked, read-only, deleted or full while
requests are served; a model that raises inside one iteration; kill -9 in the middle of a load
test and a restart on the same store."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
import pytest

from appliance.engine import SamplingParams
from appliance.telemetry import runs, store
from appliance.telemetry.writer import TelemetryWriter

ERROR_KEYS = {"message", "type", "param", "code"}
ROOT = Path(__file__).resolve().parents[1]


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def wait_idle(client: httpx.Client, timeout: float = 30.0) -> dict:
    state: dict = {}

    def idle() -> bool:
        nonlocal state
        state = client.get("/admin/state").json()
        return (state["running"], state["waiting"], state["kv_blocks_used"], state["in_flight"]) == (0, 0, 0, 0)

    wait_for(idle, timeout, "an idle engine")
    return state


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise KeyError(name)


def sql(path: Path, query: str) -> list[tuple]:
    conn = sqlite3.connect(path, timeout=10)
    try:
        return conn.execute(query).fetchall()
    finally:
        conn.close()


# -- the telemetry store breaks under a live server --------------------------------------------
def complete(client: httpx.Client, tokens: int = 6) -> str:
    """One request that must succeed; returns its id."""
    response = client.post("/v1/completions", json={"prompt": "Tell me about the sea.", "max_tokens": tokens,
                                                    "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == tokens
    return response.json()["id"]


def serve_through_fault(server_factory, path: Path, break_store: Callable[[], None],
                        repair_store: Callable[[], None], **writer_options) -> tuple[TelemetryWriter, list[str]]:
    """Serve before, during and after a store fault. The writer's buffer is small (40 records,
    a request of 6 tokens makes 7) so rows are dropped within a few requests. Returns the
    writer and the ids of the requests sent after the repair."""
    url = f"sqlite:///{path}"
    store.upgrade(url)
    options = dict(capacity=40, flush_interval_s=0.05, max_backoff_s=0.2, busy_timeout_ms=200, log_interval_s=60)
    writer = TelemetryWriter(url, "faults", **{**options, **writer_options})
    with server_factory(num_blocks=64, telemetry=writer) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=60) as client:
        complete(client)
        break_store()
        try:
            served = 0
            deadline = time.monotonic() + 60
            while metric(client, "appliance:telemetry_rows_dropped_total") == 0:  # serving goes on
                assert time.monotonic() < deadline, "no telemetry row was ever dropped"
                complete(client)
                served += 1
            assert served >= 2 and not writer.healthy
            dropped = client.get("/admin/state").json()["telemetry_rows_dropped"]
            assert dropped > 0
            for _ in range(3):
                complete(client)
            assert metric(client, "appliance:telemetry_rows_dropped_total") >= dropped
        finally:
            repair_store()
        after = [complete(client) for _ in range(2)]
        assert writer.flush(30), "writing did not resume after the repair"
        assert writer.healthy
        wait_idle(client)
        # every drop is counted in the store too, once it works again
        assert writer.flush(10)
        total_dropped = client.get("/admin/state").json()["telemetry_rows_dropped"]
        assert total_dropped == writer.rows_dropped
    assert sql(path, "SELECT coalesce(sum(count), 0) FROM telemetry_drops") == [(writer.rows_dropped,)]
    return writer, after


def stored_ids(path: Path) -> set[str]:
    return {r[0] for r in sql(path, "SELECT request_id FROM requests")}


def test_store_locked_by_another_writer(server_factory, tmp_path):
    path = tmp_path / "telemetry.db"
    holder: list[sqlite3.Connection] = []

    def lock() -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        holder.append(conn)

    def unlock() -> None:
        holder[0].execute("COMMIT")
        holder[0].close()

    _, after = serve_through_fault(server_factory, path, lock, unlock)
    assert set(after) <= stored_ids(path)


def test_store_made_read_only(server_factory, tmp_path):
    # root ignores permission bits; the immutable attribute binds root too (as in
    # tests/test_telemetry_writer.py; the -shm file stays writable, SQLite maps it)
    path = tmp_path / "telemetry.db"
    probe = tmp_path / "probe"
    probe.write_text("x")
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(probe)]).returncode != 0:
        pytest.skip("cannot set the immutable attribute here")
    subprocess.run(["chattr", "-i", str(probe)], check=True)
    files = [str(path), f"{path}-wal"]
    try:
        _, after = serve_through_fault(server_factory, path,
                                       lambda: subprocess.run(["chattr", "+i", *files], check=True),
                                       lambda: subprocess.run(["chattr", "-i", *files], check=True))
    finally:
        subprocess.run(["chattr", "-i", *[f for f in files if os.path.exists(f)]])
    assert set(after) <= stored_ids(path)


def test_store_deleted_and_its_path_blocked_until_repaired(server_factory, tmp_path):
    path = tmp_path / "telemetry.db"

    def delete_and_block() -> None:
        os.unlink(path)
        os.mkdir(path)  # a directory where the file was: SQLite cannot recreate it

    _, after = serve_through_fault(server_factory, path, delete_and_block, lambda: os.rmdir(path))
    assert store.current(f"sqlite:///{path}") == store.head()  # recreated at the head revision
    assert set(after) <= stored_ids(path)


def test_store_file_deleted_is_recreated_while_serving(server_factory, tmp_path):
    path = tmp_path / "telemetry.db"
    url = f"sqlite:///{path}"
    store.upgrade(url)
    writer = TelemetryWriter(url, "faults", flush_interval_s=0.05)
    with server_factory(num_blocks=64, telemetry=writer) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=60) as client:
        before = complete(client)
        assert writer.flush(10)
        os.unlink(path)  # as `rm telemetry.db` does it
        after = [complete(client) for _ in range(3)]
        assert writer.flush(20)
        assert client.get("/admin/state").json()["telemetry_rows_dropped"] == 0
    assert store.current(url) == store.head()
    assert stored_ids(path) >= set(after) and before not in stored_ids(path)


def test_store_full(server_factory, tmp_path):
    path = tmp_path / "telemetry.db"
    store.upgrade(f"sqlite:///{path}")
    limit = sql(path, "PRAGMA page_count")[0][0] + 64  # a size-limited store (the writer's max_page_count)

    def fill() -> None:
        """Another process's rows take what room is left (copies of the server's own rows)."""
        conn = sqlite3.connect(path, timeout=10, isolation_level=None)
        conn.execute(f"PRAGMA max_page_count = {limit}")
        names = [r[1] for r in conn.execute("PRAGMA table_info(iterations)")]
        columns = ", ".join(n for n in names if n not in ("id", "replica_id"))
        batch = 1024
        try:
            while batch:  # until not even one more row fits
                try:
                    conn.execute(f"INSERT INTO iterations (replica_id, {columns}) "
                                 f"SELECT 'filler', {columns} FROM iterations LIMIT {batch}")
                except sqlite3.OperationalError as exc:
                    assert "full" in str(exc)
                    batch //= 2
        finally:
            conn.close()

    def free_space() -> None:  # the operator deletes the other process's rows
        conn = sqlite3.connect(path, timeout=10)
        with conn:
            conn.execute("DELETE FROM iterations WHERE replica_id = 'filler'")
        conn.close()

    _, after = serve_through_fault(server_factory, path, fill, free_space, sqlite_pragmas={"max_page_count": limit})
    assert set(after) <= stored_ids(path)


# -- the model raises inside one iteration --------------------------------------------------------
class FailOnce:
    """Wraps ModelRunner.execute; raises on the next call once armed, then works again."""

    def __init__(self, execute):
        self.execute = execute
        self.armed = False
        self.failed = 0

    def __call__(self, sched):
        if self.armed:
            self.armed = False
            self.failed += 1
            raise RuntimeError("injected fault: CUDA error: an illegal memory access was encountered")
        return self.execute(sched)


def test_model_fault_in_one_iteration_ends_that_batch_and_serving_goes_on(server_factory):
    with server_factory(num_blocks=64, max_num_seqs=2) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=60) as client:
        runner = srv.state.engine.runner
        fault = FailOnce(runner.execute)
        runner.execute = fault  # instance attribute: the engine calls self.runner.execute
        body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}

        async def scenario():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as c:
                async def streamed():
                    events = []
                    async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                        assert response.status_code == 200
                        async for line in response.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line[6:])
                    return events

                running = [asyncio.create_task(streamed()), asyncio.create_task(c.post("/v1/completions", json=body))]
                while (await c.get("/admin/state")).json()["running"] < 2:
                    await asyncio.sleep(0.02)
                # max_num_seqs=2: this one waits, outside the batch that will fail
                waiting = asyncio.create_task(c.post("/v1/completions", json={**body, "max_tokens": 5}))
                while (await c.get("/admin/state")).json()["waiting"] < 1:
                    await asyncio.sleep(0.02)
                fault.armed = True
                return await asyncio.gather(*running, waiting)

        events, plain, waited = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert fault.failed == 1
        # the streamed request of the failed batch: a last chunk with finish_reason "error",
        # an OpenAI error event, then [DONE]
        assert events[-1] == "[DONE]"
        error_event = json.loads(events[-2])
        assert set(error_event["error"]) == ERROR_KEYS and error_event["error"]["code"] == "engine_error"
        assert "RuntimeError" in error_event["error"]["message"]
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "error"
        assert len(events) < 200
        # the non-streamed one: a clear error body (503, retryable), not an internal 500
        assert plain.status_code == 503 and plain.headers.get("retry-after")
        assert set(plain.json()["error"]) == ERROR_KEYS and plain.json()["error"]["code"] == "engine_error"
        # the waiting request was not in that batch: served in full
        assert waited.status_code == 200 and waited.json()["usage"]["completion_tokens"] == 5
        assert waited.json()["choices"][0]["finish_reason"] == "length"
        assert wait_idle(client)["kv_blocks_used"] == 0
        assert metric(client, "appliance:request_success_total", finished_reason="error") == 2
        assert client.get("/health").status_code == 200
        for _ in range(2):  # and it keeps serving
            ok = client.post("/v1/completions", json={**body, "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_engine_level_model_fault_fails_only_the_scheduled_requests(make_engine):
    engine = make_engine(num_blocks=64, max_num_seqs=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    prompt = engine.encode_prompt("The quick brown fox")
    for rid in ("a", "b", "c"):
        engine.add_request(rid, prompt, params)
    outputs = engine.step() + engine.step()  # a and b prefill and decode; c waits
    assert {o.request_id for o in outputs} == {"a", "b"} and engine.num_waiting == 1
    fault = FailOnce(engine.runner.execute)
    engine.runner.execute = fault
    fault.armed = True
    failed = engine.step()
    assert sorted((o.request_id, o.finished, o.finish_reason) for o in failed) == [
        ("a", True, "error"), ("b", True, "error")]
    assert all(o.error and "RuntimeError" in o.error for o in failed)
    assert engine.block_manager.num_used_blocks == 0  # a's and b's blocks are free
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finals) == ["c"] and (finals["c"].finish_reason, finals["c"].output_tokens) == ("length", 4)
    assert engine.block_manager.num_used_blocks == 0
    again = engine.generate([prompt], params)[0]
    assert (again.finish_reason, again.output_tokens) == ("length", 4)
    assert again.token_ids == finals["c"].token_ids  # greedy: the fault left no trace in the cache


# -- kill -9 in the middle of a load test --------------------------------------------------------
def bench(url: str, db: str, log: Path) -> subprocess.Popen:
    """`appliance bench` against `url`, storing its run in `db`."""
    cmd = [sys.executable, "-m", "appliance.cli", "bench", "--base-url", url, "--workload", "skewed",
           "--num-requests", "64", "--concurrency", "4", "--db", db, "--request-timeout", "30", "--json"]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def test_kill_9_during_a_load_test_then_restart_on_the_same_store(spawn_server, tmp_path):
    path = tmp_path / "telemetry.db"
    db = f"sqlite:///{path}"
    args = ("--num-blocks", "128", "--db", db, "--no-dashboard", "--replica-id", "crashy")
    server = spawn_server(*args)
    survivor = bench(server.base_url, db, tmp_path / "bench-survivor.log")  # its client outlives the server
    doomed = bench(server.base_url, db, tmp_path / "bench-doomed.log")  # killed with it (power loss)
    procs = [survivor, doomed]
    try:
        def mid_run() -> bool:
            assert survivor.poll() is None and doomed.poll() is None, "a bench ended before the kill"
            try:
                running = runs.list_runs(db, status="running")
            except Exception:  # noqa: BLE001 - the benches may be creating the store right now
                return False
            if len(running) < 2 or httpx.get(f"{server.base_url}/admin/state").json()["running"] == 0:
                return False
            return sql(path, "SELECT count(*) FROM requests")[0][0] >= 2  # some finished and were stored

        wait_for(mid_run, 120, "both load tests to be running, some of their requests done")
        finished_before = sql(path, "SELECT count(*) FROM requests")[0][0]
        os.kill(server.proc.pid, signal.SIGKILL)
        os.kill(doomed.pid, signal.SIGKILL)
        assert server.proc.wait(10) == -signal.SIGKILL and doomed.wait(10) == -signal.SIGKILL
        assert survivor.wait(120) == 1  # its requests failed: exit status 1, run stored
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    stale = runs.list_runs(db, status="running")
    assert len(stale) == 1  # the doomed client's run, left "running" by the crash

    restarted = spawn_server(*args)
    assert store.current(db) == store.head()
    assert sql(path, "PRAGMA integrity_check") == [("ok",)]
    assert runs.get_run(db, stale[0]["id"])["status"] == "interrupted"
    assert runs.get_run(db, stale[0]["id"])["ended_at"] is not None
    assert runs.list_runs(db, status="running") == []
    survived = [r for r in runs.list_runs(db) if r["id"] != stale[0]["id"]]
    assert len(survived) == 1 and survived[0]["status"] == "completed"
    summary = survived[0]["summary"]["summary"]  # what it measured before and after the kill
    assert summary["failed"] > 0 and summary["completed"] + summary["failed"] == 64
    assert "marked 1 run(s) left running as interrupted" in restarted.log()
    # the store from before the crash is still there, and the new process writes to it
    with httpx.Client(base_url=restarted.base_url, timeout=60) as client:
        rid = complete(client, tokens=3)
        wait_for(lambda: rid in stored_ids(path), 20, "the restarted server's telemetry")
    assert sql(path, "SELECT count(*) FROM requests")[0][0] > finished_before
    restarted.terminate()
    assert restarted.proc.wait(60) == 0
