"""`appliance serve` as a subprocess on 127.0.0.1 for the benchmark scripts: started with
`python -m appliance.cli serve --port P ...`, waited for on /health, stopped by its PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    base_url: str
    db_url: str
    pid: int


@contextmanager
def server_process(*serve_args: str, ready_timeout_s: float = 300.0, dashboard: bool = False,
                   env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A fresh `appliance serve` with its store in a temp folder (the dashboard at /ui only when
    asked), ready on /health; stopped by its PID afterwards. Its log is shown if it fails.
    `env`: variables added to this process's environment for the server (e.g. OMP_NUM_THREADS)."""
    folder = Path(tempfile.mkdtemp(prefix="appliance-bench-"))
    db = f"sqlite:///{folder / 'telemetry.db'}"
    port = free_port()
    cmd = [sys.executable, "-m", "appliance.cli", "serve", "--port", str(port), "--db", db, *serve_args]
    if not dashboard:
        cmd.append("--no-dashboard")
    log_path = folder / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready in {ready_timeout_s:g}s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        print(f"server pid {proc.pid} on {url} (log {log_path}, store {db})", file=sys.stderr)
        yield ServerProcess(url, db, proc.pid)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)


@contextmanager
def appliance_server(*serve_args: str, ready_timeout_s: float = 300.0, dashboard: bool = False) -> Iterator[tuple[str, str]]:
    """Yield (base URL, telemetry store URL) of a fresh `server_process`."""
    with server_process(*serve_args, ready_timeout_s=ready_timeout_s, dashboard=dashboard) as server:
        yield server.base_url, server.db_url


def patch_knobs(base_url: str, knobs: dict) -> dict:
    """PATCH /admin/knobs; the knobs in force after the change took effect."""
    response = httpx.patch(f"{base_url}/admin/knobs", json=knobs, timeout=60.0)
    response.raise_for_status()
    return response.json()["knobs"]
