"""Rank a tuning grid in simulation (`appliance tune --simulate`): replay the workload at every
grid point and order the points as the live sweep would choose among them (meeting the SLO
first, then goodput, then output throughput), so only the top few need measuring live."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from appliance.bench.metrics import SLO
from appliance.engine.knobs import KnobError
from appliance.sim.records import RecordedRun
from appliance.sim.replay import SimRequest, StepTimer, replay
from appliance.sim.whatif import scenario


@dataclass
class RankedPoint:
    knobs: dict[str, int]
    predicted: dict[str, float | None]  # SweepPoint's metric names

    @property
    def key(self) -> tuple[bool, float, float]:
        p = self.predicted
        return bool(p["meets_slo"]), p["goodput"] or 0.0, p["output_throughput"] or 0.0


def rank_grid(run: RecordedRun, timer: StepTimer, points: Sequence[dict[str, int]], requests: Sequence[SimRequest],
              slo: SLO, attainment: float, concurrency: int | None = None) -> tuple[list[RankedPoint], list[Any]]:
    """(valid points best first with their predicted figures, [(knobs, reason)] of invalid ones)."""
    ranked, invalid = [], []
    for knobs in points:
        try:
            s = scenario(run.knobs, run.cache, knobs)
        except KnobError as exc:
            invalid.append((knobs, str(exc)))
            continue
        summary = replay(requests, s.knobs, s.cache, timer, slo=slo, concurrency=concurrency).summary
        share = (summary.slo_met or 0) / summary.num_requests
        ranked.append(RankedPoint(dict(knobs), {
            "output_throughput": summary.output_throughput, "request_throughput": summary.request_throughput,
            "ttft_p99": summary.ttft.p99, "itl_p99": summary.itl.p99, "goodput": summary.goodput,
            "attainment": share, "meets_slo": float(share >= attainment)}))
    ranked.sort(key=lambda p: p.key, reverse=True)
    return ranked, invalid
