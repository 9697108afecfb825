"""The operator's questions, answered by replay: what would this run have looked like under other
knobs (one change, or a grid), and how many replicas hold a request rate within an SLO.

Every answer carries the step-time model it used (its held-out error and the window it was
fitted on) and, for a recorded run, the replay at the recorded knobs beside what was measured:
the simulator's own error on that run.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from appliance.bench.loadgen import arrival_offsets
from appliance.bench.metrics import SLO, RequestResult, Summary, summarize
from appliance.bench.workloads import BenchRequest
from appliance.engine.knobs import KnobError, Knobs, field_errors
from appliance.sim.fit import StepTimeModel, fit_step_time, usable_rows
from appliance.sim.records import RecordedRun, iteration_rows, latest_model, save_model
from appliance.sim.replay import CacheShape, ReplayResult, SimRequest, StepTimer, replay

CACHE_SETTINGS = ("num_blocks",)  # what-if settings beside the knobs (a restart would apply them)
MAX_GRID_POINTS = 1000


@dataclass
class Scenario:
    """One setting to replay: the changes asked for, and the knobs and cache they lead to."""

    changes: dict[str, Any]
    knobs: Knobs
    cache: CacheShape

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.changes.items()) or "recorded knobs"


@dataclass
class Outcome:
    """A scenario's replay (or why it was skipped)."""

    scenario: Scenario | None
    label: str
    result: ReplayResult | None = None
    skipped: str | None = None


def parse_value(text: str) -> int | str:
    """A knob value as typed: an integer when it reads as one, else the text (a policy name)."""
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        return text


def parse_assignments(items: Sequence[str], flag: str = "--set") -> dict[str, Any]:
    """["max_num_seqs=16", ...] -> {"max_num_seqs": 16}; ValueError naming a malformed item."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"{flag} {item!r}: expected KNOB=VALUE, e.g. max_num_seqs=16")
        out[name.strip()] = parse_value(value)
    return out


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """["max_num_seqs=8,16", ...] -> {"max_num_seqs": [8, 16]}; ValueError naming a bad item."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        parsed = [parse_value(v) for v in values.split(",") if v.strip()]
        if not sep or not name.strip() or not parsed:
            raise ValueError(f"--grid {item!r}: expected KNOB=V1,V2,..., e.g. max_num_seqs=8,16,32")
        if name.strip() in grid:
            raise ValueError(f"--grid {item!r}: {name.strip()} is given twice")
        grid[name.strip()] = parsed
    return grid


def scenario(base_knobs: Knobs, base_cache: CacheShape, changes: Mapping[str, Any]) -> Scenario:
    """Apply knob and cache changes; KnobError names every bad field (nothing is applied)."""
    knob_changes = {k: v for k, v in changes.items() if k not in CACHE_SETTINGS}
    errors: dict[str, str] = {}
    cache = base_cache
    if "num_blocks" in changes:
        value = changes["num_blocks"]
        if not isinstance(value, int) or value < 1:
            errors["num_blocks"] = f"must be a positive integer, got {value!r}"
        else:
            cache = replace(base_cache, num_blocks=value)
    try:
        knobs = base_knobs.with_changes(knob_changes)
    except KnobError as exc:
        errors.update(exc.errors)
        knobs = base_knobs
    if errors:
        raise KnobError(errors)
    return Scenario(dict(changes), knobs, cache)


def grid_scenarios(base_knobs: Knobs, base_cache: CacheShape, grid: Mapping[str, Sequence[Any]],
                   fixed: Mapping[str, Any] | None = None) -> list[tuple[dict[str, Any], Scenario | str]]:
    """Every grid point (with `fixed` changes on top): its Scenario, or why it is invalid.

    Unknown names and values that are wrong on their own (types, ranges) are errors for the whole
    grid (KnobError naming them); points that only break a cross-knob rule are skipped with it.
    """
    fixed = dict(fixed or {})
    for name, values in grid.items():
        for value in values:  # each value on its own must be acceptable somewhere
            _check_alone(base_knobs, base_cache, name, value)
    names = list(grid)
    size = 1
    for values in grid.values():
        size *= len(values)
    if size > MAX_GRID_POINTS:
        raise ValueError(f"the grid has {size} points; at most {MAX_GRID_POINTS}")
    out: list[tuple[dict[str, Any], Scenario | str]] = []
    for combo in itertools.product(*(grid[n] for n in names)):
        changes = {**fixed, **dict(zip(names, combo))}
        try:
            out.append((changes, scenario(base_knobs, base_cache, changes)))
        except KnobError as exc:
            out.append((changes, str(exc)))
    return out


def _check_alone(knobs: Knobs, cache: CacheShape, name: str, value: Any) -> None:
    """KnobError when a grid value is wrong on its own (unknown knob, wrong type or range)."""
    if name in CACHE_SETTINGS:
        scenario(knobs, cache, {name: value})
    elif name not in Knobs.names():
        raise KnobError({name: "unknown knob"})
    elif errors := field_errors({name: value}):
        raise KnobError(errors)


# ------------------------------------------------------------------------------- the questions


def fit_for_run(target: Any, run: RecordedRun, *, since: float | None = None, until: float | None = None,
                store: bool = True, refit: bool = False) -> StepTimeModel:
    """The step-time model of the run's own iterations (or of its replica's [since, until]), kept
    in the store. A stored run's own model is fitted once: the store's model for this run and
    engine is reused while it covers every iteration of the run and keeps the step-time spread
    (older fits did not; `refit`: fit again anyway)."""
    if since is None:
        rows, run_id = run.iterations, run.run_id or None
        stored = None if run_id is None or refit else latest_model(target, run.key, run_id)
        if stored is not None and stored.noise and stored.rows_used + stored.rows_held_out == len(usable_rows(rows)):
            return stored
    else:
        rows, run_id = iteration_rows(target, run.replica_id, since, until if until is not None else float("inf")), None
    model = fit_step_time(rows, run.key, replica_id=run.replica_id, run_id=run_id)
    if store:
        save_model(target, model)
    return model


def run_concurrency(run: RecordedRun) -> int | None:
    """The run's closed-loop concurrency (None: open-loop arrivals)."""
    return run.arrival.get("concurrency") if run.arrival.get("mode") == "concurrency" else None


def what_if(run: RecordedRun, timer: StepTimer, settings: Sequence[tuple[dict[str, Any], Scenario | str]],
            slo: SLO | None, requests: Sequence[SimRequest] | None = None,
            concurrency: int | None = None) -> list[Outcome]:
    """`requests` (default: the run's own, closed-loop if the run was) replayed at the run's
    recorded knobs first, then at every setting (skipped ones kept with their reason)."""
    if requests is None:
        requests, concurrency = run.requests, run_concurrency(run)
    base = Scenario({}, run.knobs, run.cache)
    outcomes = [Outcome(base, base.label, replay(requests, base.knobs, base.cache, timer, slo=slo,
                                                 concurrency=concurrency))]
    for changes, s in settings:
        label = ", ".join(f"{k}={v}" for k, v in changes.items())
        if isinstance(s, str):
            outcomes.append(Outcome(None, label, skipped=s))
        else:
            outcomes.append(Outcome(s, label, replay(requests, s.knobs, s.cache, timer, slo=slo,
                                                     concurrency=concurrency)))
    return outcomes


def workload_requests(requests: Sequence[BenchRequest], rate: float | None, seed: int) -> list[SimRequest]:
    """An `appliance bench` workload as replay requests, with the load generator's own arrival
    times (Poisson at `rate`, the workload's offsets, or all at once). Closed loops such as
    multi-turn conversations are refused: their later prompts depend on the replies."""
    if not all(isinstance(r, BenchRequest) for r in requests):
        raise ValueError("the simulator replays single requests; a closed-loop workload (multi-turn) "
                         "depends on the model's replies and cannot be replayed")
    out = []
    for i, (r, t) in enumerate(zip(requests, arrival_offsets(requests, rate, seed))):
        prompt = r.prompt_len if r.prompt_len is not None else (len(r.prompt_ids) if r.prompt_ids is not None else None)
        if prompt is None or r.output_len is None:
            raise ValueError(f"workload request {i}: the simulator needs its prompt length in tokens and a forced "
                             "output length (give prompt_ids and output_len)")
        out.append(SimRequest(t, prompt, r.output_len))
    return out


@dataclass
class FleetPoint:
    replicas: int
    summary: Summary
    attainment: float | None  # share of requests within the SLO (None without one)


def resample(requests: Sequence[SimRequest], n: int, rate: float, seed: int) -> list[SimRequest]:
    """`n` requests with the lengths of `requests` (cycled, shuffled by `seed`) at Poisson `rate`."""
    if not requests:
        raise ValueError("no requests to resample")
    rng = random.Random(seed)
    order = list(requests)
    rng.shuffle(order)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        r = order[i % len(order)]
        out.append(SimRequest(t, r.prompt_tokens, r.output_tokens, cached_tokens=r.cached_tokens))
    return out


def fleet(requests: Sequence[SimRequest], replicas: int, s: Scenario, timer: StepTimer, slo: SLO | None) -> FleetPoint:
    """`replicas` identical engines behind a round-robin router: each replays its share, and the
    fleet's summary covers every request (throughput over the longest replica's time)."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    merged: list[RequestResult] = []
    duration = 0.0
    for k in range(replicas):
        share = [r for i, r in enumerate(requests) if i % replicas == k]
        if not share:
            continue
        out = replay(share, s.knobs, s.cache, timer, slo=slo)
        duration = max(duration, out.duration_s)
        merged.extend(out.results)
    summary = summarize(merged, max(duration, 1e-9), len(requests), slo)
    attainment = None if slo is None else (summary.slo_met or 0) / summary.num_requests
    return FleetPoint(replicas, summary, attainment)


def size_fleet(requests: Sequence[SimRequest], max_replicas: int, s: Scenario, timer: StepTimer, slo: SLO,
               attainment: float) -> tuple[list[FleetPoint], int | None]:
    """Fleets of 1..max_replicas until one holds `attainment` of the requests within `slo`;
    returns every point tried and the smallest that does (None: none up to max_replicas)."""
    if max_replicas < 1:
        raise ValueError(f"--max-replicas must be at least 1, got {max_replicas}")
    points = []
    for n in range(1, max_replicas + 1):
        point = fleet(requests, n, s, timer, slo)
        points.append(point)
        if point.attainment is not None and point.attainment >= attainment:
            return points, n
    return points, None
