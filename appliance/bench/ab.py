"""Static vs continuous batching on one server: the same workload under each policy.

The policy is switched live (PATCH /admin/knobs {"scheduling_policy": ...}): continuous first,
then static, then the policy the server had is restored. Both runs are stored. The static
run's convoy effect is read from the server's ITERATION telemetry: the rows computed only as
padding (finished requests kept in the batch until its longest member ends) against the real
tokens scheduled (`padding_tokens` vs `scheduled_tokens`).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Any, Callable

import httpx

from appliance.bench.loadgen import BenchError, LoadGenerator, fetch_knobs
from appliance.bench.report.analysis import metric_value
from appliance.bench.report.data import IterationTotals, iteration_totals, wait_for_server_rows
from appliance.bench.runner import BenchmarkRun, run_benchmark
from appliance.numeric import ms_text
from appliance.policies import POLICIES
from appliance.wire import SOURCE_HEADER

TELEMETRY_TIMEOUT_S = 15.0


@dataclass
class ABResult:
    runs: dict[str, BenchmarkRun]  # by policy, in the order run
    original_policy: str
    totals: dict[str, IterationTotals | None]  # iteration telemetry per policy (None: not found)
    telemetry_note: str | None = None  # why iteration figures are missing

    @property
    def convoy(self) -> IterationTotals | None:
        """The static run's iteration figures (padding vs real work)."""
        return self.totals.get("static")

    def ratio(self, key: str) -> float | None:
        """static / continuous of one summary figure (dotted key, e.g. "ttft.p99")."""
        if len(self.runs) < 2:
            return None
        cont = metric_value(self.runs["continuous"].load.summary.as_dict(), key)
        stat = metric_value(self.runs["static"].load.summary.as_dict(), key)
        return stat / cont if cont and stat is not None else None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "original_policy": self.original_policy,
            "runs": {policy: run.as_dict() for policy, run in self.runs.items()},
            "iterations": {},
            "ratios_static_over_continuous": {key: self.ratio(key) for key, _, _ in ROWS},
            "telemetry_note": self.telemetry_note,
        }
        for policy, totals in self.totals.items():
            out["iterations"][policy] = None if totals is None else {
                **asdict(totals), "padding_share": totals.padding_share}
        return out


async def run_ab(
    make_generator: Callable[[], LoadGenerator],
    *,
    workload: str,
    name: str | None = None,
    db_url: str | None = None,
    telemetry_timeout_s: float = TELEMETRY_TIMEOUT_S,
) -> ABResult:
    """Run the workload under each policy (a fresh generator from `make_generator` per run).

    BenchError when the server is not the appliance or refuses the policy change. A cancelled
    continuous run skips the static one. The original policy is restored in every case.
    """
    first = make_generator()
    headers = {"Authorization": f"Bearer {first.api_key}"} if first.api_key else {}
    async with httpx.AsyncClient(base_url=first.base_url, headers=headers, timeout=60.0) as client:
        view = await fetch_knobs(client)
        if view is None:
            raise BenchError(f"--ab needs the appliance server (GET {first.base_url}/admin/knobs failed)")
        original = view["knobs"]["scheduling_policy"]
        runs: dict[str, BenchmarkRun] = {}
        try:
            for policy in POLICIES:
                await set_policy(client, policy)
                generator = first if policy == POLICIES[0] else make_generator()
                label = f"{name or workload} [{policy}]"
                run = await run_benchmark(generator, workload=workload, name=label, db_url=db_url)
                runs[policy] = run
                if run.load.stopped == "cancelled":
                    break
        finally:
            await asyncio.shield(set_policy(client, original))
    totals, note = await asyncio.to_thread(_iteration_figures, runs, db_url, telemetry_timeout_s)
    return ABResult(runs, original, totals, note)


async def set_policy(client: httpx.AsyncClient, policy: str) -> None:
    try:
        response = await client.patch("/admin/knobs", json={"scheduling_policy": policy},
                                      headers={SOURCE_HEADER: "ab-test"})
    except httpx.HTTPError as exc:
        raise BenchError(f"PATCH /admin/knobs failed: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise BenchError(f"PATCH /admin/knobs scheduling_policy={policy}: HTTP {response.status_code}: "
                         f"{response.text[:300]}")


def _iteration_figures(
    runs: dict[str, BenchmarkRun], db_url: str | None, timeout_s: float
) -> tuple[dict[str, IterationTotals | None], str | None]:
    totals: dict[str, IterationTotals | None] = {policy: None for policy in runs}
    if db_url is None:
        return totals, "no telemetry store given: padding figures need --db (the server's store)"
    missing: list[str] = []
    for policy, run in runs.items():
        load = run.load
        if missing or run.storage_error or load.replica_id is None:  # one run's rows missing: all are
            missing.append(policy)
            continue
        if not wait_for_server_rows(db_url, run.run_id, load.summary.sent, timeout_s):
            missing.append(policy)
            continue
        totals[policy] = iteration_totals(db_url, load.replica_id, load.started_at, load.finished_at)
    note = None
    if missing:
        note = (f"the server's telemetry for the {' and '.join(missing)} run was not found in {db_url} "
                "(is the server writing to this store?); padding figures are incomplete")
    return totals, note


# ---------------------------------------------------------------------------------- printing

# (summary key, label, unit: "ms" for seconds shown as ms)
ROWS: tuple[tuple[str, str, str], ...] = (
    ("request_throughput", "Request throughput", "req/s"),
    ("output_throughput", "Output throughput", "tok/s"),
    ("total_token_throughput", "Total throughput", "tok/s"),
    ("duration_s", "Duration", "s"),
    ("ttft.p50", "TTFT P50", "ms"),
    ("ttft.p99", "TTFT P99", "ms"),
    ("tpot.p50", "TPOT P50", "ms"),
    ("itl.p99", "ITL P99", "ms"),
    ("e2e.p50", "E2E P50", "ms"),
    ("e2e.p99", "E2E P99", "ms"),
)


def _cell(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return ms_text(value, 1, "") if unit == "ms" else f"{value:.2f}"


def format_ab(result: ABResult) -> str:
    """Both runs side by side, the static/continuous ratios and the convoy figures."""
    runs = result.runs
    cols = [p for p in POLICIES if p in runs]
    lines = [f"{'':<26}" + "".join(f"{p:>14}" for p in cols) + f"{'static/cont.':>14}"]
    completed = [f"{runs[p].load.summary.completed}/{runs[p].load.summary.num_requests}" for p in cols]
    lines.append(f"{'Completed':<26}" + "".join(f"{c:>14}" for c in completed))
    for key, label, unit in ROWS:
        values = [metric_value(runs[p].load.summary.as_dict(), key) for p in cols]
        ratio = result.ratio(key)
        lines.append(f"{label + ' (' + unit + ')':<26}" + "".join(f"{_cell(v, unit):>14}" for v in values)
                     + (f"{ratio:>13.2f}x" if ratio is not None else f"{'-':>14}"))
    for label, attr in (("Iterations", "iterations"), ("Real tokens computed", "scheduled_tokens"),
                        ("Padding rows", "padding_tokens"), ("Preemptions", "preemptions")):
        cells = ["-" if result.totals.get(p) is None else str(getattr(result.totals[p], attr)) for p in cols]
        lines.append(f"{label:<26}" + "".join(f"{c:>14}" for c in cells))
    convoy = result.convoy
    lines.append("")
    if convoy is not None and convoy.padding_share is not None:
        lines.append(f"Convoy effect: {convoy.padding_share:.1%} of the static run's computed rows were padding "
                     f"({convoy.padding_tokens} rows of finished requests waiting for their batch's longest one, "
                     f"against {convoy.scheduled_tokens} real tokens).")
    if result.telemetry_note:
        lines.append(f"Note: {result.telemetry_note}")
    lines.append("Runs: " + ", ".join(f"{p} {runs[p].run_id}" for p in cols)
                 + f"; scheduling_policy restored to {result.original_policy}.")
    return "\n".join(lines)
