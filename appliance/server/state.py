"""What the routes share: the engine, settings, metrics, readiness and in-flight accounting."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol, TypeVar

import torch

from ..engine import AsyncEngine, IterationStats, KnobChange, LLMEngine, RequestStats
from ..engine.knobs import KnobSnapshot
from ..records import StrEnum
from .autopilot import Autopilot, loop_apply
from .autopilot_policy import parse_spec
from .autopilot_worker import ChoiceWorker
from .errors import APIError, ServerErrorCode
from .metrics import ServerMetrics
from .protocol import build_request_models

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
INLINE_TOKENIZE_CHARS = 8192  # longer prompts are tokenised off the event loop
T = TypeVar("T")


class TelemetrySink(Protocol):
    """What the server needs of appliance.telemetry.writer.TelemetryWriter (a StatsSink)."""

    rows_dropped: int

    def on_iteration(self, stats: IterationStats) -> None: ...
    def on_request(self, stats: RequestStats) -> None: ...
    def on_knob_change(self, change: KnobChange) -> None: ...
    def start(self) -> Any: ...
    def close(self, timeout: float = 5.0) -> bool: ...


class ServerStatus(StrEnum):
    """The server's lifecycle (LOADING -> OK -> DRAINING -> STOPPED), as /health and
    /admin/state report it; ENGINE_STOPPED is /health's word for OK with the engine thread gone."""

    LOADING = "loading"
    OK = "ok"
    DRAINING = "draining"
    STOPPED = "stopped"
    ENGINE_STOPPED = "engine_stopped"


@dataclass
class ServerConfig:
    served_model_name: str | None = None  # default: the engine's model name
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    replica_id: str = "default"
    db_url: str | None = None  # the telemetry store (the dashboard reads it)
    self_url: str | None = None  # this server's own base URL; set: the dashboard is mounted at /ui
    autopilot: str | None = None  # SLO autopilot spec ("ttft_p99=1s,max_num_seqs=8..128"); set: on at start


class AppState:
    """Owns the AsyncEngine's lifecycle, and the telemetry writer's when given one (it is
    added to the engine's sinks here, started and closed with the app)."""

    def __init__(self, aeng: AsyncEngine, config: ServerConfig, telemetry: TelemetrySink | None = None):
        self.aeng = aeng
        self.engine: LLMEngine = aeng.engine
        self.config = config
        self.telemetry = telemetry
        self.model_name = config.served_model_name or self.engine.model_name
        self.requests = build_request_models(self.model_name, self.engine.max_model_len, self.engine.vocab_size)
        self.status = ServerStatus.LOADING
        self.inflight = 0  # generation requests with a response still being written
        self.metrics = ServerMetrics(self._metrics_snapshot)
        self.engine.add_sink(self.metrics)
        if telemetry is not None and telemetry not in self.engine.sinks:
            self.engine.add_sink(telemetry)
        self.autopilot = Autopilot(lambda: self.engine.knob_state.snapshot, fixed=self.fixed,
                                   spec=parse_spec(config.autopilot) if config.autopilot else None,
                                   worker=ChoiceWorker(), in_flight=self.engine.in_flight)
        self.engine.add_sink(self.autopilot)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._key = config.api_key.encode() if config.api_key else None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.telemetry is not None:
            self.telemetry.start()
        self.aeng.start()
        self.autopilot.start(loop_apply(self.aeng, asyncio.get_running_loop()))
        self.status = ServerStatus.OK

    async def drain(self, grace_s: float) -> int:
        """Refuse new requests, give in-flight ones `grace_s` to finish, abort the rest (their
        responses end with finish_reason "abort"), wait for responses to be written.
        Returns how many requests were aborted."""
        if self.status is ServerStatus.OK:
            self.status = ServerStatus.DRAINING
        log.info("draining: %d request(s) in flight, %.1fs grace", self.aeng.num_unfinished, grace_s)
        aborted = await self.aeng.drain(grace_s)
        deadline = time.monotonic() + 5.0
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        log.info("drained (%d request(s) aborted)", aborted)
        return aborted

    def close(self) -> None:
        self.status = ServerStatus.STOPPED
        self.autopilot.stop()
        self.aeng.shutdown()
        if self.telemetry is not None:
            self.telemetry.close()
        self._pool.shutdown(wait=False)

    @property
    def ready(self) -> bool:
        return self.status is ServerStatus.OK and self.aeng.is_running

    # -- checks -------------------------------------------------------------------------------
    def authorized(self, header: str | None) -> bool:
        if self._key is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key)

    def check_admitting(self) -> None:
        if self.status is ServerStatus.DRAINING or not self.aeng.admitting:
            raise APIError(503, "the server is shutting down and accepts no new requests",
                           code=ServerErrorCode.DRAINING, headers={"Retry-After": "1"})
        if not self.ready:
            raise APIError(503, "the engine is not running", code=ServerErrorCode.ENGINE_UNAVAILABLE)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code=ServerErrorCode.MODEL_NOT_FOUND)

    async def run_tokenizer(self, fn: Callable[[], T], size: int) -> T:
        """Tokenise inline when short, else on a worker thread (never stalls the event loop)."""
        if size <= INLINE_TOKENIZE_CHARS:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    # -- views --------------------------------------------------------------------------------
    def telemetry_rows_dropped(self) -> int:
        return int(self.telemetry.rows_dropped) if self.telemetry is not None else 0

    def fixed(self) -> dict[str, Any]:
        cfg = self.engine.config
        bm = self.engine.block_manager
        return {
            "block_size": cfg.block_size,
            "num_blocks": bm.num_blocks,
            "kv_cache_tokens": bm.num_blocks * cfg.block_size,
            "max_model_len": self.engine.max_model_len,
            "model": self.model_name,
            "device": str(self.engine.device),
            "dtype": str(self.engine.loaded.dtype).removeprefix("torch."),
            "cpu_kernels": self.engine.cpu_kernels,
            "threads": torch.get_num_threads(),
        }

    def knob_snapshot(self) -> KnobSnapshot:
        """The knobs in force with their version and history, as the engine thread last published them."""
        return self.aeng.snapshot()["knob_state"]

    def knobs_view(self) -> dict[str, Any]:
        snap = self.knob_snapshot()
        return {"knobs": snap.knobs.as_dict(), "version": snap.version, "iteration": snap.iteration,
                "fixed": self.fixed()}

    def state_view(self) -> dict[str, Any]:
        snap = self.aeng.snapshot()
        return {
            "status": self.status,
            "running": snap["running"],
            "waiting": snap["waiting"],
            "kv_blocks_used": snap["kv_blocks_used"],
            "kv_blocks_free": snap["kv_blocks_free"],
            "kv_blocks_cached_free": snap["kv_blocks_cached_free"],
            "kv_blocks_total": snap["kv_blocks_total"],
            "iteration": snap["iteration"],
            "knob_version": snap["knob_version"],
            "uptime_s": round(time.time() - self.aeng.started_at, 3),
            "model": self.model_name,
            "device": str(self.engine.device),
            "replica_id": self.config.replica_id,
            "telemetry_rows_dropped": self.telemetry_rows_dropped(),
            "in_flight": self.inflight,
            "autopilot": self.autopilot.view()["status"],  # "off", "watching", "holding: ...", "off after an error: ..."
        }

    def _metrics_snapshot(self) -> dict[str, Any]:
        snap = self.aeng.snapshot()
        snap["telemetry_rows_dropped"] = self.telemetry_rows_dropped()
        return snap
