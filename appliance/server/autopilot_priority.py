"""The lowest CPU priority, for the autopilot's worker to take before anything else. This module
imports nothing but os: unpickled as the worker's initializer, it imports nothing heavy at
normal priority."""

import os


def lowest_cpu_priority() -> None:
    """Nice 19 and, where the kernel has it (Linux), SCHED_IDLE: the process runs only on a CPU
    nothing else wants, and a waking normal thread preempts it at once. At nice 19 alone it may
    keep a core for its slice when an engine thread wakes, and the engine's OpenMP team then waits
    at the barrier (benchmarks/autopilot.py run 25: steps ~10 % slower while a round of replays
    ran, ~10 s of wall time per round, enough to push a burst's steps over the ITL target)."""
    os.nice(19)
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
