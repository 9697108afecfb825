"""One autopilot decision, taken again offline from a server's telemetry store.

The autopilot decides on records it holds in memory (the window's iterations and finished
requests, the engine's requests in flight); the store holds the same records, so a move a run
made (a knob change with source "autopilot", by its version) can be decided again afterwards with
the code as it is now: the window it read, the requests in flight at that moment, the replay of
the knobs in force against what was measured on them, and the choice. What the store lacks is
estimated: a request in flight had made its tokens evenly between its first token and its end,
and may generate as many as it finally did (its max_tokens is not stored); the operator's values
are the knobs before the first of the autopilot's moves since a person last changed one (the
knobs it was switched on with, unless it was switched on later than that).

    .venv/bin/python benchmarks/autopilot_decision.py sqlite:////tmp/appliance-bench-XXXX/telemetry.db 14 \\
        --spec ttft_p99=3s,itl_p99=150ms [--window-s 30] [--requests]

This is how run 100's replays were found to start from an empty engine (docs/autopilot_runs.md).
Not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import select

from appliance.bench.metrics import SLO
from appliance.engine.knobs import Knobs
from appliance.records import FinishReason, InFlightRequest, IterationStats, RequestStats
from appliance.server.autopilot import KEPT_STEPS, WINDOW_S
from appliance.server.autopilot_choice import choose, measured_attainment
from appliance.server.autopilot_policy import Choice, DecodeGaps, Spec, parse_spec, window_stats
from appliance.server.autopilot_requests import ReplaySet, made_by, missed_already, replayable
from appliance.sim.records import iteration_rows
from appliance.telemetry.models import KnobChangeRow, Request, Run
from appliance.telemetry.store import using_engine


@dataclass
class Decision:
    """What the autopilot held when it made move `version` (at `at`), as the store shows it."""

    at: float
    knobs: Knobs
    fixed: dict[str, Any]
    operator: dict[str, Any]
    raised: dict[str, int]
    last_raise: dict[str, int]
    iterations: list[IterationStats]
    kept: list[IterationStats]
    requests: list[RequestStats]
    in_flight: list[InFlightRequest]


def decision(url: str, version: int, window_s: float = WINDOW_S) -> Decision:
    """The autopilot's inputs just before its move `version` was applied."""
    with using_engine(url) as engine, engine.connect() as conn:
        kc, runs, req = KnobChangeRow.__table__, Run.__table__, Request.__table__
        move = conn.execute(select(kc).where(kc.c.version == version, kc.c.source == "autopilot")).first()
        if move is None:
            raise SystemExit(f"no autopilot move with version {version} in {url}")
        replica, at = move.replica_id, move.applied_at
        changes = [dict(r._mapping) for r in conn.execute(select(kc).where(kc.c.replica_id == replica)
                                                          .order_by(kc.c.version))]
        run = conn.execute(select(runs).where(runs.c.replica_id == replica, runs.c.started_at <= at)
                           .order_by(runs.c.started_at.desc()).limit(1)).first()
        if run is None:
            raise SystemExit(f"no run started before move {version}: its engine's fixed settings are unknown")
        before = knobs_before(changes, run.knobs)
        earlier = [c for c in changes if c["version"] < version]
        start = max([at - window_s, *(c["applied_at"] for c in earlier[-1:])])
        rows = [dict(r._mapping) for r in conn.execute(select(req).where(
            req.c.replica_id == replica, req.c.arrival <= at, req.c.finished >= start))]
        iterations = [_record(IterationStats, r) for r in iteration_rows(conn, replica, at - 600.0, at)]
    # the autopilot's own moves since a person last changed a knob: the operator's values are those
    # before the first of them (as at its switch-on), the raise in force the last one's, if a raise
    streak = []
    for c in earlier:
        streak = [*streak, c] if c["source"] == "autopilot" else []
    raised: dict[str, int] = {}
    for c in streak:
        name, value = next(iter(c["new"].items()))
        if value > c["old"][name]:
            raised = {name: c["old"][name]}
        elif name in raised:
            raised = {}
    kept = [*[it for it in iterations if it.prefill_tokens > 0][-KEPT_STEPS:],
            *[it for it in iterations if not it.prefill_tokens][-KEPT_STEPS:]]
    return Decision(at, Knobs(**before[version]), run.knobs["fixed"],
                    before[streak[0]["version"]] if streak else before[version], raised,
                    raised if streak and at - streak[-1]["applied_at"] >= window_s else {},
                    [it for it in iterations if it.started_at >= start], sorted(kept, key=lambda it: it.started_at),
                    [_record(RequestStats, r) for r in rows if r["finished"] <= at],
                    [in_flight(r, at) for r in rows if r["finished"] > at])


def knobs_before(changes: list[dict[str, Any]], stored: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The whole knob set in force before each change (by version), from a run's stored set
    ({"knobs", "version"}) and the changes' old and new values."""
    out: dict[int, dict[str, Any]] = {}
    back, forth = dict(stored["knobs"]), dict(stored["knobs"])
    for c in sorted((c for c in changes if c["version"] <= stored["version"]), key=lambda c: -c["version"]):
        back.update(c["old"])
        out[c["version"]] = dict(back)
    for c in sorted((c for c in changes if c["version"] > stored["version"]), key=lambda c: c["version"]):
        out[c["version"]] = dict(forth)
        forth.update(c["new"])
    return out


def in_flight(row: dict[str, Any], at: float) -> InFlightRequest:
    """A stored request as LLMEngine.in_flight would have read it at `at` (tokens made evenly
    from its first token to its end; max_tokens: the tokens it made in all)."""
    first = row["first_token"] if row["first_token"] is not None and row["first_token"] <= at else None
    admitted = row["first_scheduled"] is not None and row["first_scheduled"] <= at
    made = made_by(at, first, row["finished"], row["output_tokens"])
    return InFlightRequest(row["arrival"], row["prompt_tokens"], made, row["output_tokens"], first,
                           row["cached_tokens"] if admitted else 0)


def _record(cls: type, row: dict[str, Any]) -> Any:
    values = {f.name: row[f.name] for f in fields(cls)}
    if "finish_reason" in values:
        values["finish_reason"] = FinishReason(values["finish_reason"])
    return cls(**values)


def calibration(d: Decision, spec: Spec) -> tuple[float, list[str]]:
    """The attainment measured on the requests whose outcome was known at the decision, and one
    line per request: measured and replayed TTFT and worst gap (the replay of the knobs in force
    as `replayed` runs it, without the candidates)."""
    from appliance.server.autopilot_stalls import fit_window
    from appliance.sim.replay import CacheShape, replay

    slo = SLO(ttft=spec.targets.get("ttft_p99"), itl=spec.targets.get("itl_p99"))
    gaps = DecodeGaps.of(d.iterations)
    done, pending, start = replayable(d.requests, d.in_flight, start=min(it.started_at for it in d.iterations))
    carried = ReplaySet.of(done, pending, start=start, now=d.at)
    missed = [r for r in pending if missed_already(r, d.at, slo, gaps)]
    fixed = d.fixed
    out = replay(carried.requests, d.knobs, CacheShape(fixed["num_blocks"], fixed["block_size"], fixed["max_model_len"]),
                 fit_window(d.iterations, fixed), slo=slo)
    results = carried.results(out.results)
    lines = []
    for i, r in enumerate([*done, *pending]):
        first, end = r.first_token, (r.finished if isinstance(r, RequestStats) else d.at)
        ttft = (first if first is not None else d.at) - r.arrival
        gap = max(gaps.of_request(first, end), default=0.0) if first is not None else None
        state = "done" if isinstance(r, RequestStats) else "streaming" if first is not None else "waiting"
        lines.append(f"{state:<9} {r.arrival - start:+7.2f} s prompt {r.prompt_tokens:4d} | TTFT measured "
                     f"{ttft:6.2f} s{'+' if state == 'waiting' else ' '} replayed {results[i].ttft or 0:6.2f} s | "
                     f"worst gap measured {'-' if gap is None else f'{gap * 1000:.0f} ms'} replayed "
                     f"{max(results[i].itl, default=0) * 1000:.0f} ms")
    return measured_attainment(done, slo, gaps, len(missed)), lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="the telemetry store, e.g. sqlite:////tmp/appliance-bench-XXXX/telemetry.db")
    ap.add_argument("version", type=int, help="the knob version of the autopilot's move")
    ap.add_argument("--spec", required=True, help="the autopilot's targets and bounds, as `appliance serve --autopilot`")
    ap.add_argument("--window-s", type=float, default=WINDOW_S)
    ap.add_argument("--requests", action="store_true", help="print each replayed request")
    args = ap.parse_args(argv)
    spec = parse_spec(args.spec)
    d = decision(args.url, args.version, args.window_s)
    w = window_stats(d.iterations, d.requests, in_flight=d.in_flight, now=d.at)
    print(f"move v{args.version}: knobs in force {d.knobs.as_dict()}; window {d.at - d.iterations[0].started_at:.1f} s, "
          f"{len(d.iterations)} iterations, {len(d.requests)} finished, {len(d.in_flight)} in flight "
          f"({sum(r.first_token is None for r in d.in_flight)} waiting); TTFT p99 {w.ttft_p99 or 0:.3f} s, "
          f"ITL p99 {(w.itl_p99 or 0) * 1000:.0f} ms")
    measured, lines = calibration(d, spec)
    print(f"measured on the requests whose outcome was known: {measured:.0%} within the targets")
    if args.requests:
        print("\n".join(lines))
    choice: Choice = choose(d.iterations, d.requests, d.knobs, spec, d.fixed, d.last_raise, d.kept, d.raised,
                            d.operator, d.in_flight, d.at, budget_s=600.0)
    print(f"decided now: {choice.move.changes if choice.move else 'hold'}\n  {choice.reason}")
    if choice.prediction:
        print(json.dumps(choice.prediction, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
