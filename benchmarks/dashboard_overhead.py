"""Does watching slow serving? Engine throughput with two live dashboards open vs none.

One server (dashboard mounted at /ui), one workload (skewed, all at once, forced lengths), sent
in alternating rounds in one run, each round in three modes:

- `none`: nobody watches;
- `viewers`: two simulated viewers, no browser: each calls the endpoint the Live tab's timer
  calls (`/ui/gradio_api/call/live_tick`, in a Gradio session of its own, as a browser page
  does) once a second over plain HTTP and reads the whole answer. This is the server-side share
  of watching: the telemetry queries, the figures, Gradio's queue and the JSON on the wire, in
  the server process. (`--endpoint live_refresh` measures a dashboard from before live_tick,
  whose timer called live_refresh.);
- `browsers`: two headless Chromium pages on the Live tab (charts refreshing by themselves), each
  with a viewport tall enough (1280x1700) that all eight charts are on screen and painted.

Prints output tok/s of each round, the mean per mode and its ratio to `none`, and the CPU
seconds that the server process, the browsers and this script (load generator and simulated
viewers) used per second of each mode (from /proc: Linux only). Last, with the engine idle, the
server's CPU s/s with nobody watching and with the two simulated viewers: the dashboard's own
cost in the server, apart from the engine's (whose torch threads take whatever CPU there is, so
its CPU time under load says little about what watching cost).

On this 2-core box the browsers (and this script) share the server's cores, so the `browsers`
figure also counts Chromium's own rendering against the engine; an operator's browser normally
runs on another machine, where only the server-side share (`viewers`) would remain.

    .venv/bin/python benchmarks/dashboard_overhead.py [--num-requests 32] [--rounds 2]
    (--rounds 0: only the idle-engine CPU phases)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bench_server import server_process

from appliance.bench.loadgen import LoadGenerator
from appliance.bench.workloads import skewed

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MODES = ("none", "viewers", "browsers")
VIEWERS = 2
VIEWPORT = {"width": 1280, "height": 1700}  # the whole Live tab in view
REFRESH_S = 1.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------ CPU accounting


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process, from /proc/PID/stat."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def process_cpu_s(pid: int) -> float:
    stat = _stat(pid)
    return stat[1] if stat else 0.0


def descendants_cpu_s(root: int, skip: set[int]) -> float:
    """CPU seconds of the live descendants of `root` (not counting `skip`): the Playwright driver
    and the Chromium processes it started."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat:
                parents[int(entry)], cpu[int(entry)] = stat
    total = 0.0
    for pid in cpu:
        p, seen = pid, 0
        while p in parents and p != root and seen < 64:
            p, seen = parents[p], seen + 1
        if p == root and pid != root and pid not in skip:
            total += cpu[pid]
    return total


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


# ------------------------------------------------------------------------------------ watchers


@contextlib.contextmanager
def browsers(ui_url: str, count: int):
    """`count` Chromium pages showing the Live tab."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            for _ in range(count):
                page = browser.new_page(viewport=VIEWPORT)
                page.goto(ui_url)
                page.wait_for_selector("#chart-running .main-svg", timeout=120_000)
            yield
        finally:
            browser.close()


@dataclass
class ViewerStats:
    calls: int = 0
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    answer_bytes: int = 0


def refresh_once(client: httpx.Client, ui_url: str, endpoint: str, session: str) -> int:
    """One Live refresh through Gradio's HTTP API in `session`; the size of the answer."""
    response = client.post(f"{ui_url}gradio_api/call/{endpoint}",
                           json={"data": ["1m", False], "session_hash": session})
    response.raise_for_status()
    event_id = response.json()["event_id"]
    response = client.get(f"{ui_url}gradio_api/call/{endpoint}/{event_id}")
    response.raise_for_status()
    text = response.text
    if "event: complete" not in text:
        raise RuntimeError(f"refresh did not complete: {text[:300]}")
    data = json.loads(text.split("event: complete", 1)[1].split("data:", 1)[1].strip().splitlines()[0])
    if len(data) < 10:  # headline, eight charts, knobs in force (+ the timer's state and interval)
        raise RuntimeError(f"refresh answered {len(data)} outputs, expected at least 10")
    return len(text)


@contextlib.contextmanager
def viewers(ui_url: str, count: int, endpoint: str):
    """`count` threads, each calling the Live refresh once a second in a session of its own
    (like a browser page's timer while data changes)."""
    stop = threading.Event()
    stats = ViewerStats()

    def loop(offset: float) -> None:
        session = f"viewer-{uuid.uuid4().hex[:12]}"
        with httpx.Client(timeout=30.0) as client:
            time.sleep(offset)
            next_at = time.monotonic()
            while not stop.is_set():
                started = time.monotonic()
                try:
                    stats.answer_bytes += refresh_once(client, ui_url, endpoint, session)
                    stats.latencies.append(time.monotonic() - started)
                except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                    stats.errors.append(f"{type(exc).__name__}: {exc}")
                stats.calls += 1
                next_at = max(next_at + REFRESH_S, time.monotonic())
                stop.wait(next_at - time.monotonic())

    threads = [threading.Thread(target=loop, args=(i * REFRESH_S / count,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    try:
        yield stats
    finally:
        stop.set()
        for t in threads:
            t.join(60)


# -------------------------------------------------------------------------------------- rounds


def one_round(base_url: str, requests) -> float:
    """Send the workload from a thread of its own (Playwright's sync API holds this thread's loop)."""
    gen = LoadGenerator(requests, base_url=base_url, seed=0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        result = pool.submit(asyncio.run, gen.run()).result()
    return result.summary.output_throughput


@dataclass
class Round:
    mode: str
    tok_s: float
    wall_s: float
    server_cpu_s: float
    browser_cpu_s: float
    script_cpu_s: float
    note: str = ""


def measured_round(server, ui_url: str, mode: str, requests, endpoint: str) -> Round:
    me = os.getpid()
    with contextlib.ExitStack() as stack:
        watching = None
        if mode == "browsers":
            stack.enter_context(browsers(ui_url, VIEWERS))
        elif mode == "viewers":
            watching = stack.enter_context(viewers(ui_url, VIEWERS, endpoint))
        server0, browser0, own0 = (process_cpu_s(server.pid), descendants_cpu_s(me, {server.pid}),
                                   own_cpu_s())
        started = time.monotonic()
        rate = one_round(server.base_url, requests)
        wall = time.monotonic() - started
        server1, browser1, own1 = (process_cpu_s(server.pid), descendants_cpu_s(me, {server.pid}),
                                   own_cpu_s())
    note = ""
    if watching is not None:
        lat = sorted(watching.latencies) or [0.0]
        note = (f"{watching.calls} refreshes, {len(watching.errors)} failed, latency p50 "
                f"{1000 * lat[len(lat) // 2]:.0f} ms, {watching.answer_bytes / max(watching.calls, 1) / 1024:.0f} KiB each")
        if watching.errors:
            note += f" (first: {watching.errors[0][:120]})"
    return Round(mode, rate, wall, server1 - server0, browser1 - browser0, own1 - own0, note)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--endpoint", default="live_tick", help="what the simulated viewers call (the timer's endpoint)")
    ap.add_argument("--idle-seconds", type=float, default=15.0, help="length of each idle-engine CPU phase")
    args = ap.parse_args()
    requests = skewed(args.num_requests, 0)
    results: list[Round] = []
    with server_process("--dtype", args.dtype, "--max-num-seqs", "64", dashboard=True) as server:
        ui_url = f"{server.base_url}/ui/"
        one_round(server.base_url, requests[:4])  # warm-up: the engine
        with httpx.Client(timeout=60.0) as client:
            refresh_once(client, ui_url, args.endpoint, "warm-up")  # and the dashboard's refresh path
        for rnd in range(args.rounds):
            order = MODES if rnd % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                r = measured_round(server, ui_url, mode, requests, args.endpoint)
                results.append(r)
                print(f"round {rnd + 1}, {mode:8s}: {r.tok_s:5.1f} output tok/s in {r.wall_s:5.1f} s; CPU s per s: "
                      f"server {r.server_cpu_s / r.wall_s:.2f}, browsers {r.browser_cpu_s / r.wall_s:.2f}, "
                      f"script {r.script_cpu_s / r.wall_s:.2f}" + (f"; {r.note}" if r.note else ""), flush=True)
        quiet, watched = idle_server_cpu(server, ui_url, args.endpoint, args.idle_seconds)
    print()
    base = statistics.mean(r.tok_s for r in results if r.mode == "none") if results else 0.0
    for mode in MODES if results else ():
        rounds = [r for r in results if r.mode == mode]
        rate = statistics.mean(r.tok_s for r in rounds)
        wall = sum(r.wall_s for r in rounds)
        cpu = {k: sum(getattr(r, f"{k}_cpu_s") for r in rounds) / wall for k in ("server", "browser", "script")}
        label = {"none": "no dashboard", "viewers": f"{VIEWERS} simulated viewers (server-side share)",
                 "browsers": f"{VIEWERS} Chromium dashboards (server + browsers)"}[mode]
        print(f"{label:45s} {rate:6.1f} tok/s  ratio {rate / base:.3f} ({100 * (1 - rate / base):+5.1f} % loss)  "
              f"CPU s/s: server {cpu['server']:.2f}, browsers {cpu['browser']:.2f}, script {cpu['script']:.2f}")
    print(f"engine idle, server CPU: nobody watching {quiet:.3f} s/s, {VIEWERS} simulated viewers {watched:.3f} s/s: "
          f"watching costs the server {1000 * (watched - quiet):.0f} ms of CPU per second")


def idle_server_cpu(server, ui_url: str, endpoint: str, seconds: float) -> tuple[float, float]:
    """The server's CPU s/s with the engine idle, nobody watching vs VIEWERS simulated viewers
    (alternately, twice each): the dashboard's own cost, apart from the engine's."""
    rates: dict[str, list[float]] = {"none": [], "viewers": []}
    for mode in ("none", "viewers", "viewers", "none"):
        with viewers(ui_url, VIEWERS, endpoint) if mode == "viewers" else contextlib.nullcontext():
            time.sleep(2.0)  # the viewers' first calls
            cpu0, t0 = process_cpu_s(server.pid), time.monotonic()
            time.sleep(seconds)
            rates[mode].append((process_cpu_s(server.pid) - cpu0) / (time.monotonic() - t0))
    return statistics.mean(rates["none"]), statistics.mean(rates["viewers"])


if __name__ == "__main__":
    main()
