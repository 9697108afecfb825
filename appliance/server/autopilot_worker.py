"""The autopilot's simulations in a process of their own, at the lowest CPU priority.

A round of replays is seconds of pure Python. Run in the server's process it holds the GIL that
the engine thread takes back after every tensor op, so each engine step it overlaps stalls by
hundreds of milliseconds: a stall in every stream in flight, once per round (measured with
benchmarks/autopilot.py: decode-only steps of 200-470 ms, one every ~10 s, against 30-45 ms
otherwise). In a worker process at nice 19 it takes only the CPU the engine leaves. The worker
lowers its priority before it imports anything heavy (the simulator, numpy, torch): those imports
are a second or two of CPU, and at normal priority, started at the autopilot's first decision,
they stalled the steps of the streams then in flight by up to 300 ms.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from .autopilot_choice import replayed
from .autopilot_policy import Choice

TIMEOUT_S = 120.0  # the first call also starts the worker (imports included)


class ChoiceWorker:
    """`replayed` run in one spawned worker process, started by `start` or at first use; `close`
    ends it. A worker that dies or hangs raises here (the autopilot then turns itself off;
    serving goes on) and is let go: the next `start` makes a fresh one."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()  # the autopilot's thread and a PATCH may both start it

    def start(self) -> ProcessPoolExecutor:
        """Start the worker and its imports now, without waiting for them (the autopilot calls this
        when it is switched on, so its first decision does not wait on them); the pool."""
        with self._lock:
            if self._pool is None:
                # os.nice is a builtin: unpickling it imports nothing, so the worker lowers its
                # priority before the first job's function (this module, the simulator) is
                # unpickled; spawn re-runs only the parent's main module first (`appliance.cli`,
                # whose top level imports argparse and sys alone)
                pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                           initializer=os.nice, initargs=(19,))
                try:
                    pool.submit(_import_replayed)
                except BaseException:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
                self._pool = pool
            return self._pool

    def replayed(self, *args: Any, **kwargs: Any) -> Choice:
        """`autopilot_choice.replayed` in the worker."""
        pool = self.start()
        try:
            return pool.submit(replayed, *args, **kwargs).result(TIMEOUT_S)
        except (BrokenProcessPool, TimeoutError):
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise

    def pid(self) -> int | None:
        """The worker's PID once it runs (None before `start` or the first call)."""
        processes = getattr(self._pool, "_processes", None) or {}
        return next(iter(processes), None)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _import_replayed() -> None:
    """A job whose unpickling in the worker imports this module, and so `replayed` with it."""
