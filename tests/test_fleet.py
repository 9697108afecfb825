"""The fleet (`appliance serve --replicas N`): two engine replicas on a local Ray Serve cluster
(127.0.0.1, CPU, the default model) behind the ingress, driven with the `openai` client.

One Ray cluster for this module: started by the `fleet` fixture, stopped at its end. A second
fleet (`joined`, an `appliance serve --ray-address` process with a PostgreSQL store) joins that
cluster rather than starting one."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.fleet.options import fleet_spec
from appliance.fleet.ray_env import apply_ray_env

apply_ray_env(loopback_only=True)  # as `appliance serve --replicas` on 127.0.0.1 does, before Ray is imported
pytest.importorskip("ray.serve", reason="the fleet needs the `fleet` extra (ray[serve])")

from conftest import TEST_DEVICE, TEST_MODEL, run_app  # noqa: E402

REPLICA_HEADER = "x-appliance-replica"
PROMPTS = [f"Name {n} things that are {colour}." for n in (2, 3) for colour in ("red", "blue", "green", "cold")]


def _args(**flags) -> argparse.Namespace:
    base = dict(replicas=2, ray_address=None, min_replicas=None, max_replicas=None, target_ongoing_requests=None,
                upscale_delay_s=None, downscale_delay_s=None, replica_num_cpus=None, ray_dashboard=False)
    return argparse.Namespace(**{**base, **flags})


def _server(**options) -> dict:
    """The validated server options fleet_spec reads (appliance.server.cli.server_options)."""
    return {"db": None, "host": "127.0.0.1", "replica_id": "host:8000", **options}


# -- without Ray ------------------------------------------------------------------------------------
def test_single_process_serve_does_not_import_ray():
    code = ("import sys, appliance.server.cli, appliance.cli as c; c.build_parser().parse_args(['serve']); "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_sqlite_refused_when_replicas_may_be_on_other_hosts():
    with pytest.raises(ValueError, match="PostgreSQL URL"):
        fleet_spec(_args(ray_address="10.0.0.5:6379"), _server(db="sqlite:///appliance.db"))
    spec = fleet_spec(_args(ray_address="10.0.0.5:6379"), _server(db="postgresql+psycopg://u@h/d"))
    assert spec.ray_address == "10.0.0.5:6379"
    assert fleet_spec(_args(), _server(db="sqlite:///appliance.db")).replicas == 2


@pytest.mark.parametrize("flags, named", [
    (dict(replicas=0), "--replicas"),
    (dict(replicas=3, max_replicas=2), "--max-replicas"),
    (dict(replicas=1, min_replicas=2), "--min-replicas"),
    (dict(target_ongoing_requests=0.0), "--target-ongoing-requests"),
    (dict(replica_num_cpus=-1.0), "--replica-num-cpus"),
    (dict(upscale_delay_s=-1.0), "--upscale-delay-s"),
    (dict(downscale_delay_s=float("nan")), "--downscale-delay-s"),
])
def test_bad_fleet_flags_are_named(flags, named):
    with pytest.raises(ValueError, match=named):
        fleet_spec(_args(**flags), _server())


def test_autopilot_with_replicas_is_refused_by_name():
    with pytest.raises(ValueError, match="--autopilot"):
        fleet_spec(_args(), _server(autopilot="ttft_p99=1s"))


def test_autoscaling_flags_map_to_ray_serve_names():
    spec = fleet_spec(_args(replicas=2, min_replicas=1, max_replicas=3, target_ongoing_requests=4.0,
                            replica_num_cpus=0.5), _server())
    options = spec.deployment_options()
    assert options["autoscaling_config"] == {"initial_replicas": 2, "min_replicas": 1, "max_replicas": 3,
                                             "target_ongoing_requests": 4.0}
    assert options["ray_actor_options"] == {"num_cpus": 0.5} and "num_replicas" not in options
    assert spec.torch_threads == 1
    delays = fleet_spec(_args(replicas=1, upscale_delay_s=0.0, downscale_delay_s=5.0), _server())
    assert delays.deployment_options()["autoscaling_config"] == {
        "initial_replicas": 1, "min_replicas": 1, "max_replicas": 1, "upscale_delay_s": 0.0, "downscale_delay_s": 5.0}
    assert fleet_spec(_args(), _server()).deployment_options()["num_replicas"] == 2


def test_each_fleet_id_names_its_own_serve_application_and_registry():
    """Fleets sharing one Ray cluster (--ray-address) must not replace each other's."""
    one, other = (fleet_spec(_args(), _server(replica_id=rid)) for rid in ("host-a:8000", "host-b:8000"))
    assert one.app_name == "appliance-host-a-8000" and one.registry_name == "appliance-registry-host-a-8000"
    assert one.app_name != other.app_name and one.registry_name != other.registry_name


# -- a fleet of two replicas ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from appliance.engine import EngineConfig
    from appliance.fleet.cluster import start_fleet, stop_fleet
    from appliance.fleet.ingress import build_ingress
    from appliance.fleet.replica import ReplicaSettings
    from appliance.server.state import ServerConfig
    from appliance.telemetry import store

    db_url = f"sqlite:///{tmp_path_factory.mktemp('fleet') / 'telemetry.db'}"
    store.upgrade(db_url)
    spec = fleet_spec(_args(replicas=2, replica_num_cpus=0.5), _server(db=db_url, replica_id="fleet-test"))
    settings = ReplicaSettings(
        engine=EngineConfig(model=TEST_MODEL, dtype="float32", device=TEST_DEVICE, num_blocks=256),
        server=ServerConfig(replica_id="fleet-test", db_url=db_url), max_waiting=None, db_url=db_url,
        telemetry_retention=None, torch_threads=spec.torch_threads)
    fleet = start_fleet(spec, settings)
    try:
        with run_app(build_ingress(fleet)) as url:
            fleet.base_url, fleet.db_url, fleet.spec = url, db_url, spec
            yield fleet
    finally:
        stop_fleet(spec)


@pytest.fixture(scope="module")
def http(fleet):
    with httpx.Client(base_url=fleet.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def replica_ids(http) -> list[str]:
    return _wait_for_replicas(http, 2, timeout_s=60)  # each is listed from its first poll


def _chat(client: openai.OpenAI, prompt: str) -> tuple[str, str]:
    raw = client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0)
    return raw.parse().choices[0].message.content, raw.headers.get(REPLICA_HEADER, "")


def test_32_concurrent_requests_match_one_engine_and_use_both_replicas(fleet, live_server, replica_ids):
    fleet_client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    one_client = openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    requests = PROMPTS * 4  # 32 concurrent
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda p: _chat(fleet_client, p), requests))
    expected = {p: _chat(one_client, p)[0] for p in PROMPTS}
    assert [text for text, _ in answers] == [expected[p] for p in requests]
    assert {replica for _, replica in answers} == set(replica_ids)


def test_a_load_test_through_the_fleet_reports_its_size_and_balance(fleet, replica_ids):
    """appliance bench against the ingress: each streamed response names its replica, and the
    summary counts completed requests by replica (the fleet size and its load balance)."""
    import asyncio

    from appliance.bench.loadgen import LoadGenerator
    from appliance.bench.workloads import BenchRequest, skewed_corpus_ids

    corpus = skewed_corpus_ids()
    requests = [BenchRequest(None, corpus[20 * i: 20 * i + 8 + i], 4) for i in range(16)]
    generator = LoadGenerator(requests, base_url=fleet.base_url, seed=1)
    summary = asyncio.run(generator.run()).summary
    assert summary.completed == 16
    assert set(summary.replicas) == set(replica_ids) and sum(summary.replicas.values()) == 16
    assert summary.balance.startswith("2 replicas: ")


@pytest.mark.browser
def test_the_dashboards_replica_selector_in_chromium(fleet, replica_ids, browser):
    """The dashboard on the fleet's port (as `appliance serve --replicas` mounts it): the Live
    tab's running chart draws each replica and the fleet total, the selector offers the fleet and
    each replica, and picking one shows that replica alone."""
    import dataclasses

    from appliance.fleet.ingress import Fleet, build_ingress

    def with_dashboard(url: str):
        return build_ingress(Fleet(fleet.handle, fleet.registry, dataclasses.replace(
            fleet.config, db_url=fleet.db_url, self_url=url)))

    client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    with ThreadPoolExecutor(16) as pool:  # both replicas run iterations within the Live tab's minute
        served = {replica for _, replica in pool.map(lambda p: _chat(client, p), PROMPTS * 2)}
    assert served == set(replica_ids)
    stop = threading.Event()

    def keep_serving() -> None:
        """Bursts like the one above until the chart is read (at most 150 s): on a loaded box the
        dashboard may start later than the Live tab's minute after that burst."""
        deadline = time.monotonic() + 150
        with ThreadPoolExecutor(16) as pool:
            while not stop.is_set() and time.monotonic() < deadline:
                list(pool.map(lambda p: _chat(client, p), PROMPTS * 2))

    traffic = threading.Thread(target=keep_serving, daemon=True)
    traffic.start()
    with run_app(build=with_dashboard) as url:
        context = browser.new_context(viewport={"width": 1600, "height": 1100})
        try:
            page = context.new_page()
            page.goto(f"{url}/ui")
            legend = "#chart-running .legendtext"
            page.wait_for_function(
                f"""(ids) => {{ const names = [...document.querySelectorAll('{legend}')].map(e => e.textContent);
                    return names.includes('fleet total (mean)') && ids.every(id => names.includes('replica ' + id)); }}""",
                arg=replica_ids, timeout=60_000)
            stop.set()
            page.locator("#live-replica input").click()
            options = page.get_by_role("option")
            options.filter(has_text=f"replica {replica_ids[1]}").wait_for(timeout=30_000)
            assert {"fleet (all replicas)", *(f"replica {r}" for r in replica_ids)} <= {
                text.replace("✓", "").strip() for text in options.all_text_contents()}  # ✓ marks the selected one
            options.filter(has_text=f"replica {replica_ids[0]}").click()
            page.wait_for_function(
                f"""() => {{ const names = [...document.querySelectorAll('{legend}')].map(e => e.textContent);
                    return names.includes('running (mean)') && !names.some(n => n.startsWith('replica ')); }}""",
                timeout=60_000)
        finally:
            stop.set()
            context.close()
            traffic.join(timeout=300)


def test_the_fleet_size_is_a_telemetry_series(fleet, replica_ids):
    """The ingress stores the number of live replicas when it changes: the series reaches 2."""
    from appliance.telemetry import fleet_sizes

    deadline = time.monotonic() + 60
    while True:
        points = fleet_sizes.series(fleet.db_url, "fleet-test", 0.0, time.time() + 1)
        if points and points[-1][1] == len(replica_ids):
            break
        assert time.monotonic() < deadline, points
        time.sleep(0.5)
    assert all(0 <= n <= 2 for _, n in points) and [t for t, _ in points] == sorted(t for t, _ in points)


def _listening_sockets(pids: set[int]) -> list[tuple[int, ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(pid, address, port) of every listening TCP socket the processes `pids` hold, from /proc."""
    owner: dict[int, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    owner[int(link[8:-1])] = pid
        except OSError:  # the process ended meanwhile
            continue
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or int(fields[9]) not in owner:  # 0A: LISTEN
                    continue
                hex_address, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_address)  # each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                address = ipaddress.ip_address(raw)
                if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
                    address = address.ipv4_mapped
                out.append((owner[int(fields[9])], address, int(hex_port, 16)))
    return out


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/net"), reason="reads listening sockets from Linux's /proc")
def test_every_listener_of_a_local_fleet_is_on_loopback(fleet, replica_ids):
    """The ingress, the GCS, the raylet, every worker (replicas included) and Ray's agents: this
    process and everything it started listen on 127.0.0.1 only."""
    sockets = _listening_sockets(_descendants(os.getpid()))
    names = {pid: open(f"/proc/{pid}/comm").read().strip() for pid, _, _ in sockets if os.path.exists(f"/proc/{pid}")}
    assert len({pid for pid, _, _ in sockets}) >= 4, sockets  # the driver, the GCS, the raylet, workers
    assert {"gcs_server", "raylet"} <= set(names.values()), names
    exposed = [(names.get(pid), str(address), port) for pid, address, port in sockets if not address.is_loopback]
    assert not exposed, exposed


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace").split("\0")


def _environ(pid: int) -> dict[str, str]:
    """The environment `pid` started with; empty for a process that is exiting (or exited)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split("=", 1) for item in f.read().decode(errors="replace").split("\0") if "=" in item]
    return dict(pairs)


@pytest.mark.skipif(not os.path.isdir("/proc/net"), reason="reads processes from Linux's /proc")
def test_ray_runs_with_usage_reports_and_its_dashboard_off(fleet, replica_ids):
    """Offline by default: Ray's processes (the GCS, the raylet, the dashboard process that would
    send usage reports, its monitors) and its workers run with usage reporting off, and Ray's
    dashboard process runs without its web frontend (what `ray.init(include_dashboard=False)`
    keeps). Workers rename themselves over their environment's memory (`ray::...`), so a worker
    is asked through Ray for its own."""
    import ray

    commands: dict[int, list[str]] = {}
    for pid in _descendants(os.getpid()) - {os.getpid()}:
        try:
            command = _cmdline(pid)
            if command[0].startswith("/") and any("/ray/" in part for part in command[:2]):
                commands[pid] = command
        except (OSError, IndexError):  # ended meanwhile
            continue
    names = " ".join(" ".join(command[:2]) for command in commands.values())
    assert all(part in names for part in ("gcs_server", "raylet", "dashboard.py")), names
    reporting = {" ".join(commands[pid][:2])[-60:]: _environ(pid).get("RAY_USAGE_STATS_ENABLED") for pid in commands}
    assert set(reporting.values()) == {"0"}, reporting
    worker_setting = ray.get(ray.remote(lambda: os.environ.get("RAY_USAGE_STATS_ENABLED")).options(num_cpus=0).remote())
    assert worker_setting == "0"
    dashboards = [command for command in commands.values() if any(p.endswith("dashboard/dashboard.py") for p in command)]
    assert dashboards and all("--disable-frontend" in command for command in dashboards), dashboards


def test_a_replica_is_live_from_its_first_poll_until_it_stops_polling(fleet):
    """The registry lists a replica once it polls for calls (it can answer then), not when it
    joins (it is still starting), and drops it STALE_AFTER_S after its last poll."""
    import ray

    from appliance.fleet.registry import STALE_AFTER_S, FleetRegistry

    registry = FleetRegistry.remote()  # one of its own, beside the module fleet's
    try:
        assert ray.get(registry.join.remote("r1")) == {}
        assert ray.get(registry.replicas.remote()) == []
        assert ray.get(registry.next_calls.remote("r1")) == []  # a poll that waits POLL_WAIT_S for nothing
        assert ray.get(registry.replicas.remote()) == ["r1"]
        time.sleep(STALE_AFTER_S + 0.5)
        assert ray.get(registry.replicas.remote()) == []
    finally:
        ray.kill(registry)


def test_streaming_goes_through_end_to_end(fleet, replica_ids):
    client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                           temperature=0).choices[0].message.content
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                                 temperature=0, stream=True))
    assert len(chunks) > 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (["length"],
                                                                                                       ["stop"])


def test_sigterm_drains_the_ingress_as_one_box_does(fleet, replica_ids):
    """`appliance serve --replicas N`'s server on SIGTERM (its handler called as the signal would):
    new requests and /health get 503 "draining", a request that finishes within the grace ends
    normally, one that cannot is cut with a "draining" error event (no hang) and the replica
    aborts it; then the server exits. A second ingress over the module's fleet, so the other
    tests keep theirs."""
    import signal
    import threading

    import uvicorn

    from appliance.fleet.drain import IngressDrain
    from appliance.fleet.ingress import build_ingress
    from appliance.server.cli import ApplianceServer
    from conftest import tcp_socket
    from drain_check import DrainStreams, assert_refusing_while_draining

    drain = IngressDrain()
    sock = tcp_socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = ApplianceServer(uvicorn.Config(build_ingress(fleet, drain), log_level="warning", lifespan="on"),
                             drain.drain, drain_grace_s=4.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the ingress did not start"
        time.sleep(0.02)
    streams = DrainStreams(url)
    try:
        streams.start()
        server.handle_exit(signal.SIGTERM, None)
        assert_refusing_while_draining(url)
        streams.join()
        thread.join(30)
        assert not thread.is_alive(), "the ingress did not exit after the drain"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    short, long = streams.events["short"], streams.events["long"]
    assert short[-1] == {"done": True} and short[-2]["choices"][0]["finish_reason"] == "length"
    assert long[-1]["error"]["code"] == "draining"  # cut after the grace: an OpenAI-shaped error event
    assert sum(1 for event in long if "choices" in event) < 4000
    with httpx.Client(base_url=fleet.base_url, timeout=30) as http:  # the replicas aborted it: nothing left running
        deadline = time.monotonic() + 30
        while busy := sum(v["running"] + v["waiting"] for v in http.get("/admin/state").json()["replicas"].values()):
            assert time.monotonic() < deadline, f"{busy} request(s) still in the replicas' engines"
            time.sleep(0.2)


def test_api_key_guards_the_ingress(fleet):
    from appliance.fleet.ingress import Fleet, build_ingress
    from appliance.server.state import ServerConfig

    guarded = Fleet(fleet.handle, fleet.registry, ServerConfig(api_key="fleet-key"))
    with run_app(build_ingress(guarded)) as url, httpx.Client(base_url=url, timeout=120) as http:
        assert http.get("/admin/knobs").status_code == 401
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 401
        assert http.get("/admin/knobs", headers={"Authorization": "Bearer fleet-key"}).status_code == 200
        assert http.get("/health").status_code == 200


def test_knob_patch_reaches_every_replica(http, replica_ids):
    before = http.get("/admin/knobs").json()
    assert set(before["replicas"]) == set(replica_ids)
    seqs = before["knobs"]["max_num_seqs"]
    try:
        response = http.patch("/admin/knobs", json={"max_num_seqs": seqs - 1})
        assert response.status_code == 200, response.text
        body = response.json()
        assert set(body["replicas"]) == set(replica_ids)
        for replica in replica_ids:
            assert body["replicas"][replica]["version"] == before["replicas"][replica]["version"] + 1
            assert body["replicas"][replica]["knobs"]["max_num_seqs"] == seqs - 1
        assert body["fleet_knobs"]["max_num_seqs"] == seqs - 1
        after = http.get("/admin/knobs").json()
        assert {r: v["knobs"]["max_num_seqs"] for r, v in after["replicas"].items()} == dict.fromkeys(replica_ids,
                                                                                                       seqs - 1)
        history = http.get("/admin/knobs/history").json()["data"]
        changed = {row["replica"] for row in history if row["new"].get("max_num_seqs") == seqs - 1}
        assert changed == set(replica_ids)
    finally:
        assert http.patch("/admin/knobs", json={"max_num_seqs": seqs}).status_code == 200


def test_knob_patch_to_one_replica(http, replica_ids):
    target, other = replica_ids
    before = http.get("/admin/knobs").json()["replicas"]
    seqs = before[target]["knobs"]["max_num_seqs"]
    try:
        response = http.patch("/admin/knobs", params={"replica": target}, json={"max_num_seqs": seqs - 2})
        assert response.status_code == 200, response.text
        assert set(response.json()["replicas"]) == {target}
        after = http.get("/admin/knobs").json()["replicas"]
        assert after[target]["knobs"]["max_num_seqs"] == seqs - 2
        assert after[other] == before[other]
        assert http.patch("/admin/knobs", params={"replica": "nope"}, json={"max_num_seqs": 3}).status_code == 404
    finally:
        assert http.patch("/admin/knobs", params={"replica": target}, json={"max_num_seqs": seqs}).status_code == 200


def test_rejected_knob_changes_no_replica(http, replica_ids):
    before = http.get("/admin/knobs").json()["replicas"]
    response = http.patch("/admin/knobs", json={"max_num_seqs": -1})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_knobs"
    assert http.get("/admin/knobs").json()["replicas"] == before


def test_metrics_carry_a_replica_label(http, replica_ids):
    http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    assert families["appliance_fleet_replicas"].samples[0].value == 2
    labelled = {s.labels.get("replica") for f in families.values() for s in f.samples
                if f.name != "appliance_fleet_replicas"}
    assert labelled == set(replica_ids)


def test_each_replica_writes_telemetry_under_its_id(fleet, replica_ids):
    from sqlalchemy import create_engine, text

    engine = create_engine(fleet.db_url)
    deadline = time.monotonic() + 30
    try:
        while True:  # the writers flush on their own interval
            with engine.connect() as conn:
                seen = {r for (r,) in conn.execute(text("SELECT DISTINCT replica_id FROM iterations"))}
            if seen >= set(replica_ids) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        engine.dispose()
    assert seen >= set(replica_ids)


def _wait_for_replicas(http: httpx.Client, count: int, without: str | None = None,
                       timeout_s: float = 180.0) -> list[str]:
    """The ids /health lists once there are `count` (none of them `without`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ids = http.get("/health").json().get("replicas", [])
        if len(ids) == count and without not in ids:
            return ids
        assert time.monotonic() < deadline, f"replicas now {ids}"
        time.sleep(1.0)


def _stored(db_url: str, query: str) -> list[tuple]:
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(query))]
    finally:
        engine.dispose()


def test_replica_killed_mid_stream(fleet, http, replica_ids):
    """Its streams end with an OpenAI error (no hang), the other replica's streams finish, Ray Serve
    starts a replacement, and the replacement takes the fleet's knobs. Nothing the store held is
    lost: the killed replica's rows stay, and every stream the other replica finished is stored."""
    import ray

    from appliance.fleet.cluster import DEPLOYMENT_NAME

    client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    seqs = http.get("/admin/knobs").json()["knobs"]["max_num_seqs"]
    assert http.patch("/admin/knobs", json={"max_num_seqs": seqs - 3}).status_code == 200
    try:
        streams = []
        for prompt in PROMPTS[:4]:
            raw = client.chat.completions.with_raw_response.create(
                model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": prompt}], max_tokens=200,
                temperature=0, stream=True, extra_body={"ignore_eos": True})
            stream = raw.parse()
            next(iter(stream))  # generating
            streams.append((raw.headers[REPLICA_HEADER], stream))
        victim = streams[0][0]
        rows_of_victim = f"SELECT count(*) FROM iterations WHERE replica_id = '{victim}'"
        deadline = time.monotonic() + 30
        while (kept := _stored(fleet.db_url, rows_of_victim)[0][0]) == 0:  # its writer flushes on an interval
            assert time.monotonic() < deadline, "the replica stored no iteration while streaming"
            time.sleep(0.2)
        actor = f"SERVE_REPLICA::{fleet.spec.app_name}#{DEPLOYMENT_NAME}#{victim.rsplit('/', 1)[1]}"
        ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)
        finished = set()
        for replica, stream in streams:
            if replica == victim:
                with pytest.raises(openai.APIError, match="lost"):
                    list(stream)
            else:
                chunks = list(stream)
                assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 100
                finished.add(chunks[0].id)
        text, served_by = _chat(client, PROMPTS[0])  # the fleet keeps serving
        assert text and served_by != victim
        ids = _wait_for_replicas(http, 2, without=victim)
        (new,) = set(ids) - set(replica_ids)
        knobs = http.get("/admin/knobs", params={"replica": new}).json()["replicas"][new]["knobs"]
        assert knobs["max_num_seqs"] == seqs - 3
        assert _stored(fleet.db_url, rows_of_victim)[0][0] >= kept
        deadline = time.monotonic() + 30
        while not finished <= {r for (r,) in _stored(fleet.db_url, "SELECT request_id FROM requests")}:
            assert time.monotonic() < deadline, "a finished stream never reached the store"
            time.sleep(0.2)
    finally:
        assert http.patch("/admin/knobs", json={"max_num_seqs": seqs}).status_code == 200


# -- a second fleet that joins this cluster by address ----------------------------------------------
JOINED_ID = "joined"


@pytest.fixture(scope="module")
def joined(fleet, tmp_path_factory):
    """`appliance serve --replicas 1 --ray-address ADDR` as an operator runs it: a process of its
    own that joins the module's running cluster (no second one), with Ray Serve autoscaling
    between 1 and 2 replicas and a PostgreSQL store (as --ray-address requires). Its replicas run
    in bfloat16 (what `--dtype auto` takes on CPUs with fast bf16) with a 256 MiB KV cache: on an
    AMD EPYC Zen 3 (AVX2), where auto takes float32, four float32 replicas at once (this fleet's
    two while it scaled, the module's two) beside the test process took the 24 GiB box past Ray's
    memory threshold, and Ray killed the starting replica and its Serve controller."""
    import ray
    from ray import serve

    from conftest import free_port, start_server_process
    from pg_server import postgres_server

    with postgres_server() as pg:
        server = start_server_process(
            ["--no-dashboard", "--replica-id", JOINED_ID, "--db", pg.url, "--dtype", "bfloat16",
             "--kv-cache-memory", "256MiB",
             "--ray-address", ray.get_runtime_context().gcs_address, "--replicas", "1", "--min-replicas", "1",
             "--max-replicas", "2", "--target-ongoing-requests", "1", "--upscale-delay-s", "0",
             "--downscale-delay-s", "5", "--replica-num-cpus", "0.25"],
            free_port(), tmp_path_factory.mktemp("joined") / "serve.log")
        proc = server.proc
        server.pg = pg
        server.app_name = fleet_spec(_args(replicas=1), _server(replica_id=JOINED_ID)).app_name
        try:
            server.wait_ready(timeout=300)
            yield server
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
                serve.delete(server.app_name)  # what its own stop would have done


def test_a_fleet_joins_a_running_cluster_by_address(fleet, joined):
    """Its replica runs in the module's cluster (one node, both applications in one Ray Serve),
    and it started no Ray process of its own."""
    import ray
    from ray import serve

    with httpx.Client(base_url=joined.base_url, timeout=120) as http:
        (replica,) = http.get("/health").json()["replicas"]
        response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert replica.startswith(f"{JOINED_ID}/") and response.headers[REPLICA_HEADER] == replica
    assert len([node for node in ray.nodes() if node["Alive"]]) == 1
    assert {fleet.spec.app_name, joined.app_name} <= set(serve.status().applications)
    started = {open(f"/proc/{pid}/comm").read().strip() for pid in _descendants(joined.proc.pid) - {joined.proc.pid}
               if os.path.exists(f"/proc/{pid}/comm")}
    assert not started & {"gcs_server", "raylet"}, started


def _fleet_sizes(db_url: str, fleet_id: str) -> list[int]:
    from appliance.telemetry import fleet_sizes

    return [n for _, n in fleet_sizes.series(db_url, fleet_id, 0.0, time.time() + 1)]


def test_ray_serve_autoscales_the_fleet_with_its_load(joined):
    """Four clients streaming at once against a target of one ongoing request per replica: Serve
    adds the second replica (--max-replicas 2); idle again, it goes back to one (--min-replicas).
    The fleet-size series in the store follows."""
    import threading

    stop = threading.Event()

    def keep_streaming() -> list[str]:
        """Streams one after another until told to stop; what went wrong with any of them."""
        faults = []
        with httpx.Client(base_url=joined.base_url, timeout=120) as http:
            while not stop.is_set():
                with http.stream("POST", "/v1/completions", json={
                        "prompt": "Count slowly.", "max_tokens": 48, "ignore_eos": True, "stream": True}) as r:
                    lines = [line for line in r.iter_lines() if line]
                ended = r.status_code == 200 and lines[-1:] == ["data: [DONE]"]
                # an error event is a chunk with an "error" key; a chunk whose text is the word
                # "error" is none (the model samples, and may say it)
                if not ended or any("error" in json.loads(line.removeprefix("data: ")) for line in lines[:-1]):
                    faults.append(f"{r.status_code}: {lines[-2:]}")
        return faults

    with httpx.Client(base_url=joined.base_url, timeout=120) as http, ThreadPoolExecutor(4) as pool:
        loads = [pool.submit(keep_streaming) for _ in range(4)]
        try:
            _wait_for_replicas(http, 2, timeout_s=240)
        finally:
            stop.set()
        faults = [fault for load in loads for fault in load.result(timeout=120)]
        assert not faults, faults  # every stream ended well, scaling included
    # Serve's own count, not /health's (a replica whose poll is late on a loaded box drops out of
    # /health for a moment): Serve's downscale waits for its look-back window to empty first
    deadline = time.monotonic() + 180
    while (states := _replica_states(joined.app_name)) != {"RUNNING": 1}:
        assert time.monotonic() < deadline, states
        time.sleep(1.0)
    deadline = time.monotonic() + 30
    while (sizes := _fleet_sizes(joined.pg.url, JOINED_ID))[-1:] != [1] or 2 not in sizes:
        assert time.monotonic() < deadline, sizes
        time.sleep(0.5)
    assert 1 in sizes[:sizes.index(2)], sizes  # one replica, then two, then one again


def _replica_states(app_name: str) -> dict[str, int]:
    """Ray Serve's count of the application's replicas by state, e.g. {"RUNNING": 2}."""
    from ray import serve

    from appliance.fleet.cluster import DEPLOYMENT_NAME

    application = serve.status().applications.get(app_name)
    return dict(application.deployments[DEPLOYMENT_NAME].replica_states) if application else {}


def test_the_fleet_serves_with_its_store_down_and_stores_again_after(joined):
    """As on one box: PostgreSQL stopped, requests are answered as before; started again, the
    writers' retries store the requests served after it came back."""
    def complete(http: httpx.Client) -> str:
        response = http.post("/v1/completions", json={"prompt": "Tell me about the sea.", "max_tokens": 6,
                                                      "ignore_eos": True})
        assert response.status_code == 200, response.text
        return response.json()["id"]

    with httpx.Client(base_url=joined.base_url, timeout=120) as http:
        joined.pg.stop()
        try:
            for _ in range(4):
                complete(http)
            assert http.get("/health").status_code == 200
        finally:
            assert joined.pg.start() is None
        after = {complete(http) for _ in range(2)}
    deadline = time.monotonic() + 60
    while not after <= {r for (r,) in _stored(joined.pg.url, "SELECT request_id FROM requests")}:
        assert time.monotonic() < deadline, "writing did not resume after the store came back"
        time.sleep(0.5)


def test_a_joined_fleet_leaves_the_cluster_as_it_found_it(fleet, joined):
    """SIGTERM: it drains, deletes its own application and exits 0; the cluster and the module's
    fleet serve on."""
    import signal

    from ray import serve

    joined.proc.send_signal(signal.SIGTERM)
    assert joined.proc.wait(120) == 0, joined.log()[-3000:]
    assert joined.app_name not in serve.status().applications
    assert fleet.spec.app_name in serve.status().applications
    client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert _chat(client, PROMPTS[0])[0]
