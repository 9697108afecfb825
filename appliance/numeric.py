"""Number helpers shared by the validators, the bench, the telemetry queries and the dashboard
(imports nothing of the appliance, so every layer may use it)."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence


def is_int(value: Any) -> bool:
    """A JSON integer (Python's bool is an int, but never a valid count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default method.

    Sort the values; the percentile sits at fractional rank r = (n - 1) * q / 100 and is
    v[floor(r)] + (v[ceil(r)] - v[floor(r)]) * (r - floor(r)). E.g. [1, 2, 3, 4] at q=50 gives
    rank 1.5, so 2 + (3 - 2) * 0.5 = 2.5.
    """
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def to_ms(seconds: float | None, digits: int | None = None) -> float | None:
    """Seconds as milliseconds (rounded to `digits` when given); None stays None."""
    if seconds is None:
        return None
    return seconds * 1000 if digits is None else round(seconds * 1000, digits)


def ms_text(seconds: float | None, digits: int = 1, unit: str = " ms") -> str:
    """Seconds as milliseconds text, e.g. "12.5 ms" (unit="" for a bare number); "-" for None."""
    return "-" if seconds is None else f"{seconds * 1000:.{digits}f}{unit}"


def best_times(fns: Sequence[Callable[[], object]], repeats: int = 7, calls: int = 20) -> list[float]:
    """Seconds of the best of `repeats` runs of `calls` calls of each of `fns`, the runs of the
    functions alternating (so a change of the machine's speed hits all alike), after a warm-up."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best
