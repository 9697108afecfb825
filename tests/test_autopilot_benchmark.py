"""benchmarks/autopilot.py's workload and its per-phase reading of the misses (no server: the
benchmark itself takes twenty minutes and is not a test)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from autopilot import LONG_PROMPT, PHASE_S, misses, shifting_workload  # noqa: E402

from appliance.bench.metrics import RequestResult, parse_slo  # noqa: E402


def test_the_workload_shifts_shape_by_phase():
    requests = shifting_workload(scale=1.0, rate=1.5)
    phase = [[r for r in requests if int(r.arrival_offset // PHASE_S) == p] for p in range(3)]
    assert all(96 <= r.prompt_len <= 256 for r in phase[0])
    assert sum(r.prompt_len >= LONG_PROMPT for r in phase[1]) == 12  # 2 per burst, every 10 s
    assert all(16 <= r.prompt_len <= 48 for r in phase[2])
    assert requests == shifting_workload(scale=1.0, rate=1.5)  # seeded


def test_misses_are_counted_per_phase_by_what_missed():
    requests = shifting_workload(scale=1.0, rate=1.5)
    first = {p: next(i for i, r in enumerate(requests) if int(r.arrival_offset // PHASE_S) == p) for p in range(3)}
    long_one = next(i for i, r in enumerate(requests) if r.prompt_len >= LONG_PROMPT)
    results = [RequestResult(index=i, sent_at=0.0, ok=True, ttft=0.5, itl=[0.05]) for i in range(len(requests))]
    results[first[0]] = RequestResult(index=first[0], sent_at=0.0, ok=True, ttft=3.5, itl=[0.05])
    results[first[0] + 1] = RequestResult(index=first[0] + 1, sent_at=0.0, ok=True, ttft=3.5, itl=[0.2])
    results[long_one] = RequestResult(index=long_one, sent_at=0.0, ok=True, ttft=0.5, itl=[0.05, 0.16])
    results[first[2]] = RequestResult(index=first[2], sent_at=0.0, ok=False, error_kind="timeout")
    run = SimpleNamespace(load=SimpleNamespace(results=results))
    assert misses(run, requests, parse_slo("ttft=3s,itl=150ms"), PHASE_S) == [
        "2 (TTFT 1, both 1)", "1 (long ITL 1)", "1 (failed 1)"]
