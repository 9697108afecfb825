"""The engine loop in its own thread, and an asyncio face for the server.

The loop thread owns the model. Callers on the event loop talk to it through a thread-safe
command queue (add, abort, knob change); outputs come back through `call_soon_threadsafe` into
one asyncio queue per request. Nothing here blocks the event loop.

A server builds its engine with `AsyncEngine.build`, on the loop thread itself: then every torch
op of the process runs on that one thread. OpenMP (libgomp) keeps a thread team per thread that
ever ran a parallel region; with a second team (the model loaded on the main thread, the loop on
another) it counts more threads than cores and stops spinning between regions, so each of the
hundreds of parallel regions in a step waits for its workers to wake (measured: the served
engine used ~130 % of the two cores instead of ~198 %, 10-25 % slower than in-process).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping

from .engine import LLMEngine, RequestOutput
from .knobs import KnobError, KnobUpdate
from .sampling import InvalidRequestError, SamplingParams
from .stats import KnobChange

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (HTTP 429)."""


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and admits nothing new (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped."""


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    source: str
    run_id: str | None
    arrival: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class _ChangeKnobs:
    update: KnobUpdate
    done: concurrent.futures.Future  # resolved with the KnobChange (None: nothing changed) or KnobError


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.started_at = time.time()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._pending_adds = 0
        self._admitting = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._go: threading.Event | None = None  # set by `build`: its thread waits for start()
        self._started = False
        self._snapshot: dict[str, Any] = {}
        self._update_snapshot()

    @classmethod
    def build(cls, make_engine: Callable[[], LLMEngine], max_waiting: int | None = None) -> AsyncEngine:
        """Run `make_engine` (load the model, build the engine) on a new thread that then runs the
        loop once `start()` is called; returns when the engine is built, raising what building
        raised. Every torch op then runs on that one thread (see the module docstring)."""
        built: queue.SimpleQueue = queue.SimpleQueue()
        go = threading.Event()

        def loop_thread() -> None:
            try:
                aeng = cls(make_engine(), max_waiting)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
                built.put(exc)
                return
            aeng._go = go
            built.put(aeng)
            go.wait()
            if aeng._started:
                aeng._run()

        thread = threading.Thread(target=loop_thread, name="engine-loop", daemon=True)
        thread.start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        result._thread = thread
        return result

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._started = True
        if self._go is not None:
            self._go.set()
        else:
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._started and self._thread.is_alive() and not self._stop.is_set()

    @property
    def admitting(self) -> bool:
        return self._admitting

    def stop_admitting(self) -> None:
        self._admitting = False

    @property
    def num_unfinished(self) -> int:
        with self._streams_lock:
            return len(self._streams)

    async def drain(self, grace_s: float) -> int:
        """Stop admitting, wait up to `grace_s` for in-flight requests, abort the rest.

        Returns how many requests had to be aborted.
        """
        self.stop_admitting()
        deadline = time.monotonic() + grace_s
        while self.num_unfinished and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with self._streams_lock:
            leftover = list(self._streams)
        for rid in leftover:
            self.abort(rid)
        while self.num_unfinished and self.is_running:
            await asyncio.sleep(0.02)
        return len(leftover)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(None)
        if self._go is not None:
            self._go.set()  # a built engine never started: its thread ends now
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError for a request that the engine would refuse."""
        self.engine.validate_request(prompt_ids, params)

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        source: str = "api",
        run_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs; leaving early (disconnect) aborts it."""
        self.submit(request_id, prompt_ids, params, source, run_id)
        stream = self._streams[request_id][1]
        finished = False
        try:
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        source: str = "api",
        run_id: str | None = None,
    ) -> None:
        """Validate and queue a request (outputs go to its stream); raises before queueing."""
        if not self._admitting:
            raise EngineDrainingError("the server is shutting down")
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        self.validate(prompt_ids, params)
        if self.max_waiting is not None and self._snapshot["waiting"] + self._pending_adds >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
        loop = asyncio.get_running_loop()
        with self._streams_lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
            self._streams[request_id] = (loop, asyncio.Queue())
            self._pending_adds += 1
        self._commands.put(_Add(request_id, list(prompt_ids), params, source, run_id, time.time()))

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's blocks are freed at the next iteration boundary."""
        self._commands.put(_Abort(request_id))

    async def update_knobs(self, changes: Mapping[str, Any], source: str = "api", **why: Any) -> KnobChange | None:
        """Apply a change at the next iteration boundary and return it once it took effect (None
        when it changed nothing); KnobError, with nothing applied, when the set would be invalid
        (KnobConflict when `why`'s expected_version is stale). `why`: KnobUpdate's reason,
        prediction and expected_version."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_ChangeKnobs(KnobUpdate(dict(changes), source, **why), done))
        return await asyncio.wrap_future(done)

    def snapshot(self) -> dict[str, Any]:
        """Latest engine state, refreshed after every iteration (safe to call from any thread)."""
        return dict(self._snapshot)

    # -- the loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            busy = engine.has_unfinished()
            try:
                self._drain_commands(block=not busy)
                if self._stop.is_set():
                    break
                outputs = engine.step() if engine.has_unfinished() else []
            except Exception:  # a bug in the loop itself: fail every stream, never hang them
                log.exception("engine loop crashed")
                self._fail_all(EngineDeadError("the engine loop stopped after an internal error"))
                self._stop.set()
                break
            self._update_snapshot()
            if outputs:
                self._dispatch(outputs)

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: _Add | _Abort | _ChangeKnobs) -> None:
        engine = self.engine
        if isinstance(cmd, _Add):
            with self._streams_lock:
                self._pending_adds -= 1
            try:
                engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, cmd.source, cmd.run_id, cmd.arrival)
            except Exception as exc:  # noqa: BLE001 - reported to that request only
                self._dispatch_error(cmd.request_id, exc)
        elif isinstance(cmd, _Abort):
            engine.abort(cmd.request_id)
        elif isinstance(cmd, _ChangeKnobs):
            if not cmd.done.set_running_or_notify_cancel():
                return  # the caller gave up before the boundary: apply nothing
            try:
                change = engine.apply_knobs(cmd.update)
            except KnobError as exc:
                cmd.done.set_exception(exc)
                return
            self._update_snapshot()  # readers see the change once the caller hears of it
            cmd.done.set_result(change)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand one step's outputs to their streams: one event-loop wakeup per loop per step
        (not one per token: each wakeup is a self-pipe write and a loop iteration that contend
        with the engine thread for the GIL)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._streams_lock:
            for out in outputs:
                entry = self._streams.get(out.request_id)
                if entry is None:
                    continue
                batches.setdefault(entry[0], []).append((entry[1], out))
                if out.finished:
                    del self._streams[out.request_id]
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_deliver, batch)

    def _dispatch_error(self, request_id: str, exc: BaseException) -> None:
        with self._streams_lock:
            entry = self._streams.pop(request_id, None)
        if entry:
            entry[0].call_soon_threadsafe(entry[1].put_nowait, exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._streams_lock:
            entries, self._streams = list(self._streams.values()), {}
        for loop, stream in entries:
            loop.call_soon_threadsafe(stream.put_nowait, exc)

    def _update_snapshot(self) -> None:
        e = self.engine
        bm = e.block_manager
        knobs = e.knob_state.snapshot
        self._snapshot = {
            "running": e.num_running,
            "waiting": e.num_waiting,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_cached_free": bm.num_cached_free_blocks,
            "kv_blocks_total": bm.num_blocks,
            "iteration": e.iteration,
            "knob_state": knobs,  # knobs, version, history: one consistent KnobSnapshot
            "knobs": knobs.knobs.as_dict(),
            "knob_version": knobs.version,
            "uptime_s": time.time() - self.started_at,
            "last_iteration": e.last_stats.as_dict() if e.last_stats else None,
        }


def _deliver(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for stream, item in batch:
        stream.put_nowait(item)
