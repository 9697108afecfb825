"""Auto-tuning sweep on a running appliance: live knob changes, a short run per grid point.

The grid is max_num_seqs x max_num_batched_tokens x long_prefill_token_threshold (the prefill
chunk size). Each point is set with PATCH /admin/knobs (no restart), checked first with
`validate_knobs` against the server's other knobs (invalid points are skipped with the reason),
and measured with one run of the workload (stored like any run). A coarse grid comes first,
then the neighbours of the best point along each knob (midpoints towards the adjacent grid
values). Out come the Pareto fronts of output throughput against P99 TTFT and against P99 ITL,
and the recommendation: the point meeting the SLO (at least `attainment` of the requests within
every target) with the most goodput. `apply=True` leaves the recommendation set; otherwise, and
whenever the sweep fails, the original knobs are restored.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import httpx

from appliance.bench.loadgen import BenchError, LoadGenerator, fetch_knobs, normalize_base_url
from appliance.bench.metrics import SLO
from appliance.bench.runner import run_benchmark
from appliance.bench.workloads import ClosedLoop
from appliance.numeric import ms_text
from appliance.records import StrEnum
from appliance.wire import SOURCE_HEADER

TUNED = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold")
SHORT = {"max_num_seqs": "seqs", "max_num_batched_tokens": "budget", "long_prefill_token_threshold": "chunk"}
DEFAULT_ATTAINMENT = 0.9


class KnobRejected(BenchError):
    """The server refused a knob change (HTTP 422)."""


class _Stopped(Exception):
    """The sweep was cancelled (by `cancel` or a cancelled run); results so far stand."""


@dataclass(frozen=True)
class Grid:
    """The values to sweep for each tuned knob."""

    max_num_seqs: tuple[int, ...] = (8, 32, 128)
    max_num_batched_tokens: tuple[int, ...] = (256, 1024, 4096)
    long_prefill_token_threshold: tuple[int, ...] = (64, 256, 1024)

    def __post_init__(self) -> None:
        for name in TUNED:
            values = getattr(self, name)
            if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
                raise ValueError(f"grid values for {name} must be positive integers, got {values!r}")
            object.__setattr__(self, name, tuple(sorted(set(values))))

    def points(self) -> list[dict[str, int]]:
        return [dict(zip(TUNED, combo)) for combo in itertools.product(*(getattr(self, n) for n in TUNED))]


class PointStatus(StrEnum):
    """Where a sweep point stands: PENDING until measured (OK) or not (SKIPPED, FAILED)."""

    PENDING = "pending"
    OK = "ok"
    SKIPPED = "skipped"  # not run: the knobs were refused or cannot fit
    FAILED = "failed"  # run, but cancelled or no request completed


@dataclass
class SweepPoint:
    knobs: dict[str, int]  # the tuned knobs' values at this point
    stage: str  # "coarse" or "refine"
    status: PointStatus = PointStatus.PENDING
    reason: str | None = None  # why skipped or failed
    run_id: str | None = None
    completed: int = 0
    failed: int = 0
    output_throughput: float | None = None  # tok/s
    request_throughput: float | None = None
    ttft_p99: float | None = None  # seconds
    itl_p99: float | None = None
    goodput: float | None = None  # requests/s within the SLO
    attainment: float | None = None  # share of the workload's requests within the SLO
    meets_slo: bool = False
    predicted: dict[str, float | None] | None = None  # the simulator's figures (tune --simulate), same names

    def __post_init__(self) -> None:
        self.status = PointStatus(self.status)  # ValueError for an unknown status

    @property
    def label(self) -> str:
        return " ".join(f"{SHORT[k]}={self.knobs[k]}" for k in TUNED)


@dataclass
class SweepResult:
    points: list[SweepPoint]
    slo: SLO
    attainment: float
    original_knobs: dict[str, Any]
    pareto_ttft: list[int] = field(default_factory=list)  # indexes into points
    pareto_itl: list[int] = field(default_factory=list)
    recommended: int | None = None  # index of the recommended point (None: none met the SLO)
    best_goodput: int | None = None  # the most goodput of all measured points
    applied: dict[str, Any] | None = None  # knobs left set on the server when --apply
    workload: str = ""

    @property
    def recommendation(self) -> SweepPoint | None:
        return None if self.recommended is None else self.points[self.recommended]

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "slo": self.slo.as_dict(),
            "attainment": self.attainment,
            "original_knobs": self.original_knobs,
            "points": [{**asdict(p), "label": p.label} for p in self.points],
            "pareto_ttft": self.pareto_ttft,
            "pareto_itl": self.pareto_itl,
            "recommended": self.recommended,
            "recommendation": None if self.recommendation is None else self.recommendation.knobs,
            "best_goodput": self.best_goodput,
            "applied": self.applied,
        }


def pareto_front(points: Sequence[SweepPoint], latency: str) -> list[int]:
    """Indexes of the measured points no other point beats on both output throughput (higher)
    and `latency` ("ttft_p99" or "itl_p99", lower), by throughput descending."""
    candidates = [i for i, p in enumerate(points)
                  if p.status is PointStatus.OK and p.output_throughput is not None and getattr(p, latency) is not None]

    def dominates(a: SweepPoint, b: SweepPoint) -> bool:
        ta, tb, la, lb = a.output_throughput, b.output_throughput, getattr(a, latency), getattr(b, latency)
        return ta >= tb and la <= lb and (ta > tb or la < lb)

    front = [i for i in candidates if not any(dominates(points[j], points[i]) for j in candidates if j != i)]
    return sorted(front, key=lambda i: -points[i].output_throughput)


def refine_points(grid: Grid, best: dict[str, int]) -> list[dict[str, int]]:
    """Neighbours of `best`: for each knob, the geometric midpoints towards the adjacent grid
    values (others held at best)."""
    out = []
    for name in TUNED:
        values = getattr(grid, name)
        v = best[name]
        below = [x for x in values if x < v]
        above = [x for x in values if x > v]
        for other in ([below[-1]] if below else []) + ([above[0]] if above else []):
            mid = round(math.sqrt(v * other))
            if mid not in (v, other):
                out.append({**best, name: mid})
    return out


def invalid_reason(current: dict[str, Any], point: dict[str, int]) -> str | None:
    """Why `point` cannot be set on a server whose knobs are `current` (None when it can)."""
    # imported here: the package `appliance.engine` loads torch, which the CLI's parser must not wait for
    from appliance.engine.knobs import validate_knobs

    errors = validate_knobs({**current, **point}, only=set(point))
    return "; ".join(f"{k}: {v}" for k, v in errors.items()) if errors else None


async def sweep(
    requests: Sequence[ClosedLoop],
    slo: SLO,
    *,
    base_url: str,
    grid: Grid | None = None,
    refine: bool = True,
    apply: bool = False,
    attainment: float = DEFAULT_ATTAINMENT,
    rate: float | None = None,
    concurrency: int | None = None,
    seed: int = 0,
    max_duration_s: float | None = None,
    request_timeout_s: float = 600.0,
    api_key: str | None = None,
    db_url: str | None = None,
    workload: str = "custom",
    progress: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
    on_generator: Callable[[LoadGenerator], None] | None = None,
    points: Sequence[dict[str, int]] | None = None,
) -> SweepResult:
    """Sweep the grid on the server at `base_url` (see the module docstring).

    BenchError when the server is not the appliance or rejects a knob change. Setting `cancel`
    stops the sweep after the current point (the original knobs are restored). `on_point` sees
    each point as it is added (the sweep fills it in as it measures it); `on_generator` sees
    each point's load generator before its run (to follow its progress, or cancel it mid-point).
    `points` replaces the grid with these settings, measured in order without refinement (the
    simulator's top picks, `appliance tune --simulate`).
    """
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be within (0, 1], got {attainment}")
    grid = grid or Grid()
    say = progress or (lambda _msg: None)

    def make_generator() -> LoadGenerator:
        return LoadGenerator(requests, base_url=base_url, rate=rate, concurrency=concurrency, seed=seed,
                             max_duration_s=max_duration_s, api_key=api_key,
                             request_timeout_s=request_timeout_s, slo=slo)

    def next_generator() -> LoadGenerator:
        generator = make_generator()
        if on_generator is not None:
            on_generator(generator)
        return generator

    base = make_generator().base_url
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60.0) as client:
        view = await fetch_knobs(client)
        if view is None:
            raise BenchError(f"tuning needs the appliance server (GET {base}/admin/knobs failed)")
        current = dict(view["knobs"])
        original = {k: current[k] for k in TUNED}
        result = SweepResult([], slo, attainment, original, workload=workload)
        applied = False
        try:
            stages = [("coarse", grid.points())] if points is None else [("simulated", list(points))]
            while stages:
                stage, todo = stages.pop(0)
                for knobs in todo:
                    if cancel is not None and cancel.is_set():
                        raise _Stopped
                    if any(p.knobs == knobs for p in result.points):
                        continue
                    point = SweepPoint(knobs, stage)
                    result.points.append(point)
                    if on_point is not None:
                        on_point(point)
                    await _measure(client, point, current, next_generator, slo, attainment, db_url, workload)
                    say(f"[{len(result.points)}] {stage} {point.label}: {_describe(point)}")
                if stage == "coarse" and refine and points is None:
                    best = _best(result.points)
                    if best is not None:
                        stages.append(("refine", refine_points(grid, result.points[best].knobs)))
            _conclude(result)
            if apply and result.recommendation is not None:
                await apply_recommendation(client, result)
                applied = True
        except _Stopped:
            _conclude(result)
            say("sweep cancelled")
        finally:
            if not applied:
                await asyncio.shield(patch_knobs(client, original))
    return result


def run_sweep(requests: Sequence[ClosedLoop], slo: SLO, **options: Any) -> SweepResult:
    """`sweep` from synchronous code (the CLI, the dashboard's worker threads)."""
    return asyncio.run(sweep(requests, slo, **options))


async def apply_recommendation(client: httpx.AsyncClient, result: SweepResult) -> dict[str, Any]:
    """Set the sweep's recommended knobs on the server (what `--apply` does); return the knobs
    view the server answers with. BenchError when nothing is recommended or the server refuses."""
    rec = result.recommendation
    if rec is None:
        raise BenchError("no point met the SLO: there is no recommendation to apply")
    view = await patch_knobs(client, rec.knobs)
    result.applied = dict(rec.knobs)
    return view


def apply_recommendation_at(result: SweepResult, base_url: str, api_key: str | None = None) -> dict[str, Any]:
    """`apply_recommendation` on the server at `base_url`, from synchronous code (the dashboard's
    Apply button, after a sweep that left the original knobs in place)."""

    async def go() -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with httpx.AsyncClient(base_url=normalize_base_url(base_url), headers=headers,
                                     timeout=60.0) as client:
            return await apply_recommendation(client, result)

    return asyncio.run(go())


async def patch_knobs(client: httpx.AsyncClient, knobs: dict[str, Any]) -> dict[str, Any]:
    try:
        response = await client.patch("/admin/knobs", json=knobs, headers={SOURCE_HEADER: "tune"})
    except httpx.HTTPError as exc:
        raise BenchError(f"PATCH /admin/knobs failed: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        error = KnobRejected if response.status_code == 422 else BenchError
        raise error(f"PATCH /admin/knobs {knobs}: HTTP {response.status_code}: {response.text[:300]}")
    return response.json()


async def _measure(
    client: httpx.AsyncClient, point: SweepPoint, current: dict[str, Any],
    make_generator: Callable[[], LoadGenerator], slo: SLO, attainment: float,
    db_url: str | None, workload: str,
) -> None:
    reason = invalid_reason(current, point.knobs)
    if reason is not None:
        point.status, point.reason = PointStatus.SKIPPED, reason
        return
    try:
        await patch_knobs(client, point.knobs)
    except KnobRejected as exc:
        point.status, point.reason = PointStatus.SKIPPED, f"the server refused it: {exc}"
        return
    current.update(point.knobs)
    run = await run_benchmark(make_generator(), workload=workload, name=f"tune {point.label}", db_url=db_url)
    s = run.load.summary
    point.run_id = run.run_id if db_url and not run.storage_error else None
    point.completed, point.failed = s.completed, s.failed
    if run.load.stopped == "cancelled":
        point.status, point.reason = PointStatus.FAILED, "cancelled"
        raise _Stopped
    if s.completed == 0:
        point.status, point.reason = PointStatus.FAILED, f"no request completed ({s.errors})"
        return
    point.status = PointStatus.OK
    point.output_throughput, point.request_throughput = s.output_throughput, s.request_throughput
    point.ttft_p99, point.itl_p99 = s.ttft.p99, s.itl.p99
    point.goodput = s.goodput
    point.attainment = (s.slo_met or 0) / s.num_requests
    point.meets_slo = point.attainment >= attainment


def _best(points: Sequence[SweepPoint]) -> int | None:
    """The recommended point if any meets the SLO, else the one with the most goodput."""
    measured = [i for i, p in enumerate(points) if p.status is PointStatus.OK]
    meeting = [i for i in measured if points[i].meets_slo]
    pool = meeting or measured
    if not pool:
        return None
    return max(pool, key=lambda i: (points[i].goodput or 0.0, points[i].output_throughput or 0.0))


def _conclude(result: SweepResult) -> None:
    result.pareto_ttft = pareto_front(result.points, "ttft_p99")
    result.pareto_itl = pareto_front(result.points, "itl_p99")
    best = _best(result.points)
    result.best_goodput = best
    result.recommended = best if best is not None and result.points[best].meets_slo else None


def _describe(point: SweepPoint) -> str:
    if point.status is not PointStatus.OK:
        return f"{point.status} ({point.reason})"
    return (f"{point.output_throughput:.1f} tok/s, TTFT p99 {ms_text(point.ttft_p99, 0)}, ITL p99 "
            f"{ms_text(point.itl_p99, 0)}, goodput {point.goodput or 0:.2f} req/s "
            f"({(point.attainment or 0):.0%} within SLO{'' if point.meets_slo else ', misses it'})")


