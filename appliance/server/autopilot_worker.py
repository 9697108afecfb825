"""The autopilot's simulations in a process of their own, at the lowest CPU priority.

A round of replays is seconds of pure Python. Run in the server's process it holds the GIL that
the engine thread takes back after every tensor op, so each engine step it overlaps stalls by
hundreds of milliseconds: a stall in every stream in flight, once per round (measured with
benchmarks/autopilot.py: decode-only steps of 200-470 ms, one every ~10 s, against 30-45 ms
otherwise). In a worker process at nice 19 it takes only the CPU the engine leaves.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from .autopilot_choice import Choice, choose

TIMEOUT_S = 120.0  # the first call also starts the worker (imports included)


class ChoiceWorker:
    """`choose` run in one spawned worker process, started at first use; `close` ends it. A worker
    that dies or hangs raises here (the autopilot then turns itself off; serving goes on)."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    def choose(self, *args: Any, **kwargs: Any) -> Choice:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_lowest_priority)
        return self._pool.submit(choose, *args, **kwargs).result(TIMEOUT_S)

    def pid(self) -> int | None:
        """The worker's PID once it runs (None before the first call)."""
        processes = getattr(self._pool, "_processes", None) or {}
        return next(iter(processes), None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _lowest_priority() -> None:
    os.nice(19)
