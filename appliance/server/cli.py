"""`appliance serve`: flags, settings validation, and the uvicorn runner with a graceful drain.

Order at start: validate every setting (exit 2 naming the bad value), refuse a non-loopback
host without an API key, upgrade the telemetry store and mark runs left "running" as
interrupted, load the model, freeze the heap (`freeze_heap`), then bind. On SIGINT/SIGTERM the
server stops admitting (new requests get 503, /health 503), gives in-flight requests
`drain_grace_s` to finish, aborts the rest (finish reason "abort"), then shuts down and exits 0.
A second SIGINT cuts the grace short.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import logging
import math
import os
import signal
import socket
from typing import Any, Awaitable, Callable

import uvicorn

log = logging.getLogger(__name__)

API_KEY_ENV = "APPLIANCE_API_KEY"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Server flags (the engine flags come from appliance.cli). Defaults are None so the config
    file's values apply unless a flag is given."""
    parser.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port to bind (default 8000)")
    parser.add_argument("--api-key", default=None,
                        help=f"require `Authorization: Bearer KEY` on /v1 and /admin (or set {API_KEY_ENV})")
    parser.add_argument("--insecure", action="store_true",
                        help="allow a non-loopback --host without --api-key")
    parser.add_argument("--max-waiting", type=int, default=None, help="waiting-queue bound; beyond it 429")
    parser.add_argument("--max-body-bytes", default=None, help="request body limit, e.g. 1MiB (default)")
    parser.add_argument("--db", default=None,
                        help="telemetry store, any SQLAlchemy URL (default sqlite:///appliance.db)")
    parser.add_argument("--no-telemetry", action="store_true", help="do not write telemetry")
    parser.add_argument("--replica-id", default=None, help="name of this server in a shared store (default host:port)")
    parser.add_argument("--drain-grace-s", type=float, default=None,
                        help="seconds in-flight requests get to finish on SIGTERM (default 30)")
    parser.add_argument("--telemetry-retention", default=None,
                        help="keep telemetry e.g. '7d', '1000000rows', '7d,1000000rows' (default: forever)")
    parser.add_argument("--served-model-name", default=None, help="model id the API reports and accepts")
    parser.add_argument("--no-dashboard", action="store_true", help="do not mount the dashboard at /ui")
    parser.add_argument("--autopilot", default=None, metavar="SPEC",
                        help="start the SLO autopilot: targets and knob bounds, e.g. "
                             "ttft_p99=1s,itl_p99=150ms,max_num_seqs=8..128")
    from ..fleet.options import add_fleet_arguments  # no Ray import: only the fleet's runner imports Ray

    add_fleet_arguments(parser)


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 possibly in brackets) is this machine's loopback."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _self_url(host: str, port: int) -> str:
    """How this process reaches its own API (a wildcard bind is reachable on loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def server_options(settings: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Validated server settings (ValueError naming the flag and the bad value)."""
    from ..engine import parse_bytes
    from .state import DEFAULT_MAX_BODY_BYTES

    host = settings.get("host", "127.0.0.1")
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"--host must be a host name or address, got {host!r}")
    port = settings.get("port", 8000)
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"--port must be an integer between 1 and 65535, got {port!r}")
    api_key = settings.get("api_key") or os.environ.get(API_KEY_ENV) or None
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip() or not api_key.isprintable()
                                or " " in api_key):
        raise ValueError("--api-key must be a non-empty printable string without spaces")
    max_waiting = settings.get("max_waiting")
    if max_waiting is not None and (not isinstance(max_waiting, int) or isinstance(max_waiting, bool)
                                    or max_waiting < 1):
        raise ValueError(f"--max-waiting must be a positive integer, got {max_waiting!r}")
    body = settings.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    try:
        max_body = body if isinstance(body, int) and not isinstance(body, bool) else parse_bytes(str(body))
    except ValueError:
        raise ValueError(f"--max-body-bytes must be a size like 1MiB or 1048576, got {body!r}") from None
    if max_body < 1024:
        raise ValueError(f"--max-body-bytes must be at least 1024, got {body!r}")
    grace = settings.get("drain_grace_s", 30.0)
    if not isinstance(grace, (int, float)) or isinstance(grace, bool) or not math.isfinite(grace) or grace < 0:
        raise ValueError(f"--drain-grace-s must be a number >= 0, got {grace!r}")
    replica_id = settings.get("replica_id") or f"{socket.gethostname()}:{port}"[:64]
    if not isinstance(replica_id, str) or not 1 <= len(replica_id) <= 64 or not replica_id.isprintable():
        raise ValueError(f"--replica-id must be 1-64 printable characters, got {replica_id!r}")
    served = settings.get("served_model_name")
    if served is not None and (not isinstance(served, str) or not served.strip()):
        raise ValueError(f"--served-model-name must be a non-empty string, got {served!r}")
    db = None if args.no_telemetry else settings.get("db", "sqlite:///appliance.db")
    if db is not None and not isinstance(db, str):
        raise ValueError(f"--db must be a SQLAlchemy URL, got {db!r}")
    retention = settings.get("telemetry_retention")
    if retention is not None:
        from ..telemetry.retention import parse_retention

        if not isinstance(retention, str):
            raise ValueError(f"--telemetry-retention must be text like '7d', got {retention!r}")
        parse_retention(retention)
    autopilot = settings.get("autopilot")
    if autopilot is not None:
        from .autopilot_policy import SpecError, parse_spec

        try:
            parse_spec(autopilot)
        except SpecError as exc:
            raise ValueError(f"--autopilot {autopilot!r}: {exc}") from None
    if not is_loopback(host) and api_key is None and not args.insecure:
        raise ValueError(
            f"refusing to listen on {host} (not a loopback address) without an API key: anyone who can "
            f"reach it could use the model and change the knobs. Give --api-key KEY (or set {API_KEY_ENV}), "
            "or --insecure to serve without authentication anyway."
        )
    return dict(host=host, port=port, api_key=api_key, max_waiting=max_waiting, max_body_bytes=max_body,
                drain_grace_s=float(grace), replica_id=replica_id, served_model_name=served, db=db,
                telemetry_retention=retention, autopilot=autopilot)


def _check_bindable(host: str, port: int) -> None:
    """Fail before the model loads when the address cannot be bound (port in use, bad host)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind(address)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _open_telemetry(opts: dict[str, Any]):
    """Upgrade the store, mark interrupted runs, and return a (not started) TelemetryWriter."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from ..telemetry import runs, store
    from ..telemetry.writer import TelemetryWriter

    url = opts["db"]
    logging.getLogger("alembic").setLevel(logging.WARNING)  # its INFO lines are per-plugin noise
    try:
        safe = make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        raise ValueError("--db must be a SQLAlchemy URL such as sqlite:///appliance.db") from None
    try:
        store.upgrade(url)
        interrupted = runs.mark_interrupted_runs(url, opts["replica_id"])
        if interrupted:
            log.info("marked %d run(s) left running as interrupted", interrupted)
    except Exception as exc:  # noqa: BLE001 - telemetry must not keep the server from serving
        log.warning("telemetry store %s is not usable now (%s: %s); serving anyway, the writer will retry",
                    safe, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    return TelemetryWriter(url, opts["replica_id"], retention=opts["telemetry_retention"])


class RedactSecret(logging.Filter):
    """Replaces a secret (the API key) in every record a handler emits: a client that puts the
    key where it does not belong (a URL query, a request body) must not get it into the logs,
    e.g. through uvicorn's access log, which logs whole request lines."""

    def __init__(self, secret: str):
        super().__init__()
        self.secret = secret

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.secret in message:
            record.msg, record.args = message.replace(self.secret, "[redacted]"), None
        if record.exc_text and self.secret in record.exc_text:
            record.exc_text = record.exc_text.replace(self.secret, "[redacted]")
        return True


def _redact_in_logs(secret: str) -> None:
    """Install RedactSecret on every handler of the root logger (where uvicorn's and the
    appliance's records end up)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactSecret(secret))


class ApplianceServer(uvicorn.Server):
    """uvicorn.Server whose first SIGINT/SIGTERM drains the app before shutting down."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[float], Awaitable[Any]], drain_grace_s: float):
        """`drain(grace_s)` stops admitting, gives in-flight requests `grace_s`, ends the rest
        (AppState.drain on one box, IngressDrain.drain for a fleet's ingress)."""
        super().__init__(config)
        self.drain = drain
        self.drain_grace_s = drain_grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_tasks: set[asyncio.Task] = set()
        self.exit_signal: int | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """The handler uvicorn installs for SIGINT/SIGTERM while it serves (main thread only).

        uvicorn's own sets `should_exit` at once and re-raises the signal after shutdown (a
        SIGTERM would end the process with that signal, not exit 0). uvicorn has no public hook
        for this: pyproject.toml pins the uvicorn range tested, and tests/test_library_internals.py
        fails, naming the version, when it stops calling this method on a signal."""
        if self._loop is None:  # not serving yet: uvicorn's own handling
            super().handle_exit(sig, frame)
            return
        if self.exit_signal is None:
            self.exit_signal = sig
            self._loop.call_soon_threadsafe(self._begin_drain, self.drain_grace_s)
        elif sig == signal.SIGINT:  # a second Ctrl+C: abort what is left now
            self._loop.call_soon_threadsafe(self._begin_drain, 0.0)

    def _begin_drain(self, grace_s: float) -> None:
        log.info("shutting down: draining (grace %.1fs)", grace_s)
        self._drain_tasks.add(asyncio.ensure_future(self._drain_then_exit(grace_s)))

    async def _drain_then_exit(self, grace_s: float) -> None:
        try:
            await self.drain(grace_s)
        finally:
            self.should_exit = True


def freeze_heap() -> None:
    """Collect once, then move every object alive (the model's modules, torch, transformers,
    the dashboard: ~560 thousand objects) out of the cyclic collector's sight. A full collection
    holds the GIL and so stalls every stream in flight: over the whole heap it took 305-314 ms
    here (a 331 ms step in benchmarks/autopilot.py run 26, six requests past the ITL target);
    over what serving allocates after this, 6-8 ms. Objects frozen here that later become garbage
    are still freed by reference counting; only cycles among them are not."""
    gc.collect()
    gc.freeze()
    log.info("heap frozen: %d objects out of the garbage collector's full collections", gc.get_freeze_count())


def serve_main(args: argparse.Namespace) -> int:
    from ..engine import AsyncEngine, LLMEngine
    from ..settings import engine_config_from_args, merged_settings
    from .app import build_app
    from .state import ServerConfig

    if getattr(args, "replicas", None) is not None:
        from ..fleet.cli import fleet_main

        return fleet_main(args)
    opts = server_options(merged_settings(args), args)
    if opts["api_key"]:
        _redact_in_logs(opts["api_key"])
    engine_config = engine_config_from_args(args)
    _check_bindable(opts["host"], opts["port"])
    telemetry = _open_telemetry(opts) if opts["db"] else None
    aeng = AsyncEngine.build(lambda: LLMEngine(engine_config), max_waiting=opts["max_waiting"])
    config = ServerConfig(served_model_name=opts["served_model_name"], api_key=opts["api_key"],
                          max_body_bytes=opts["max_body_bytes"], replica_id=opts["replica_id"], db_url=opts["db"],
                          self_url=None if args.no_dashboard else _self_url(opts["host"], opts["port"]),
                          autopilot=opts["autopilot"])
    app = build_app(aeng, config, telemetry)
    uv_config = uvicorn.Config(app, host=opts["host"], port=opts["port"], log_config=None, lifespan="on",
                               timeout_graceful_shutdown=5, workers=1)
    server = ApplianceServer(uv_config, app.state.appliance.drain, opts["drain_grace_s"])
    freeze_heap()
    log.info("serving %s on http://%s:%d (auth %s)", app.state.appliance.model_name, opts["host"], opts["port"],
             "on" if opts["api_key"] else "off")
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind
        return exc.code if isinstance(exc.code, int) and exc.code else 1
    return 0 if server.started else 1
