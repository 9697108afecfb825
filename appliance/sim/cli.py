"""`appliance simulate`: replay a recorded run under other knobs, a grid of them, or a fleet.

    appliance simulate --run RUN_ID [--set max_num_seqs=16 ...] [--grid KNOB=v1,v2 ...]
                       [--slo ttft=500ms,tpot=100ms] [--json]
    appliance simulate --run RUN_ID --rate R (--replicas N | --max-replicas M) --slo ...

The step-time model is fitted on the run's own iterations (or `--fit-run`'s, or the last
`--fit-last` of its replica) and kept in the store; a run's model already in the store is reused
(`--refit` fits it again). The first row is the replay at the recorded
knobs, beside what was measured: the simulator's error on this run.

Exit status: 0 answered; 1 fleet sizing found no fleet within --max-replicas; 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from appliance.bench.metrics import SLO
from appliance.bench.tune import DEFAULT_ATTAINMENT
from appliance.numeric import ms_text

ALL_METRICS = (  # (label, getter over a run summary as a dict); seconds shown in ms
    ("tok/s", lambda s: s["output_throughput"]),
    *((f"{name} {p}", lambda s, key=key, p=p: s[key][p])
      for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e")) for p in ("p50", "p90", "p99")),
)
# the text table's columns (every percentile is in --json and in the dashboard's table)
METRICS = tuple(m for m in ALL_METRICS if m[0] in {"tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p50", "ITL p99",
                                                   "E2E p50", "E2E p99"})
_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def _duration(text: str) -> float:
    unit = text[-1:] if text[-1:] in _DURATION_UNITS else "s"
    number = text[:-1] if text[-1:] in _DURATION_UNITS else text
    try:
        value = float(number) * _DURATION_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration like 10m, 90s or 1h, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above zero, got {text!r}")
    return value


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    """The `appliance simulate` flags."""
    from appliance.bench.cli import _positive_float, _positive_int, _slo
    from appliance.bench.workloads import CLOSED_LOOP_WORKLOADS, WORKLOADS

    parser.add_argument("--run", required=True, metavar="RUN_ID",
                        help="recorded run to replay (its requests, knobs, KV cache and engine)")
    parser.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                        help="a knob (or num_blocks) to change, e.g. max_num_seqs=16 (repeatable)")
    parser.add_argument("--grid", action="append", default=[], metavar="KNOB=V1,V2",
                        help="replay every combination of these values (repeatable)")
    parser.add_argument("--slo", type=_slo, default=None, help="goodput targets, e.g. ttft=500ms,tpot=100ms")
    parser.add_argument("--attainment", type=float, default=DEFAULT_ATTAINMENT,
                        help=f"share of requests that must meet the SLO in fleet sizing (default {DEFAULT_ATTAINMENT})")
    parser.add_argument("--rate", type=_positive_float, default=None,
                        help="replace the run's arrivals with Poisson arrivals at R requests/s (its lengths, resampled)")
    parser.add_argument("--num-requests", "-n", type=_positive_int, default=None,
                        help="requests to resample with --rate (default: as many as the run had), or of --workload")
    parser.add_argument("--seed", type=int, default=0, help="seed of --rate's arrivals and of --workload")
    parser.add_argument("--workload", choices=[w for w in WORKLOADS if w not in CLOSED_LOOP_WORKLOADS], default=None,
                        help="replay this `appliance bench` workload (at --rate, --concurrency or all at once) "
                             "instead of the run's requests; the run gives the knobs, cache and step times")
    parser.add_argument("--file", default=None, help="JSONL file of --workload jsonl")
    parser.add_argument("--concurrency", type=_positive_int, default=None,
                        help="closed-loop arrivals for --workload, as `appliance bench --concurrency`")
    parser.add_argument("--long-prompt-len", type=_positive_int, default=1024,
                        help="prompt length of the long requests of --workload long-prompt-burst")
    parser.add_argument("--model", default=None, help="tokenizer for --workload sharegpt/skewed (default: embedded SmolLM2)")
    fleet = parser.add_mutually_exclusive_group()
    fleet.add_argument("--replicas", type=_positive_int, default=None, help="replay a fleet of N replicas (round robin)")
    fleet.add_argument("--max-replicas", type=_positive_int, default=None,
                       help="find the fewest replicas (up to M) that hold --rate within --slo")
    fit = parser.add_mutually_exclusive_group()
    fit.add_argument("--fit-run", default=None, metavar="RUN_ID", help="fit the step times on this run's iterations")
    fit.add_argument("--fit-last", type=_duration, default=None, metavar="DURATION",
                     help="fit on the run's replica's iterations of the last DURATION (e.g. 10m)")
    parser.add_argument("--refit", action="store_true",
                        help="fit the run's step times again, even when the store holds a model fitted on them")
    parser.add_argument("--db", default=None, help="telemetry store URL (default: sqlite:///appliance.db)")
    parser.add_argument("--json", action="store_true", help="print one JSON object, not a table")


def simulate_main(args: argparse.Namespace) -> int:
    """Run `appliance simulate`; return the exit status."""
    from appliance.engine.knobs import KnobError

    try:
        report, status = _simulate(args)
    except (ValueError, LookupError, FileNotFoundError, KnobError) as exc:
        print(f"appliance simulate: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report) if args.json else format_report(report))
    return status


def _simulate(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    from appliance.sim import whatif
    from appliance.sim.records import load_run
    from appliance.bench.cli import db_url
    from appliance.sim.replay import check_fits

    db = db_url(args.db)
    if (args.replicas or args.max_replicas) and args.rate is None:
        raise ValueError("fleet sizing needs --rate R (requests/s the fleet must hold)")
    if args.concurrency is not None and (args.workload is None or args.rate is not None):
        raise ValueError("--concurrency is for --workload, instead of --rate")
    if args.max_replicas and args.slo is None:
        raise ValueError("--max-replicas needs --slo, e.g. --slo ttft=500ms,tpot=100ms")
    if not 0 < args.attainment <= 1:
        raise ValueError(f"--attainment must be within (0, 1], got {args.attainment}")
    changes = whatif.parse_assignments(args.set)
    grid = whatif.parse_grid(args.grid)
    started = time.perf_counter()
    run = load_run(db, args.run)
    base = whatif.scenario(run.knobs, run.cache, changes)  # a bad --set or --grid: nothing fitted or stored
    settings = whatif.grid_scenarios(run.knobs, run.cache, grid, changes) if grid else (
        [(changes, base)] if changes else [])
    if settings and all(isinstance(s, str) for _, s in settings):
        raise ValueError(f"no valid point in the grid: {settings[0][1]}")
    workload = _workload(args)
    if workload is None and args.rate is not None:
        workload = (whatif.resample(run.requests, args.num_requests or len(run.requests), args.rate, args.seed),
                    f"the run's lengths at Poisson {args.rate:g}/s")
    for _, s in [(changes, base), *settings]:
        if not isinstance(s, str):
            check_fits(workload[0] if workload else run.requests, s.cache)
    model = _fit(db, run, args)
    report: dict[str, Any] = {"run": run_view(run), "model": model_view(model), "slo": _slo_view(args.slo)}
    status = 0
    if workload is not None:
        report["workload"] = workload[1]
    if args.replicas or args.max_replicas:
        assert workload is not None  # --rate is required above
        fleet: dict[str, Any] = {"rate": args.rate, "requests": len(workload[0]), "setting": base.label}
        if args.max_replicas:
            points, best = whatif.size_fleet(workload[0], args.max_replicas, base, model, args.slo, args.attainment)
            fleet.update(attainment=args.attainment, recommended=best)
            status = 0 if best is not None else 1
        else:
            points = [whatif.fleet(workload[0], args.replicas, base, model, args.slo)]
        report["fleet"] = {**fleet, "points": [_fleet_view(p) for p in points]}
    else:
        if workload is None:
            outcomes = whatif.what_if(run, model, settings, args.slo)
            report["recorded"] = run.summary.get("summary") if run.summary else None
        else:
            outcomes = whatif.what_if(run, model, settings, args.slo, workload[0], args.concurrency)
            report["recorded"] = None
        report["outcomes"] = [outcome_view(o) for o in outcomes]
    report["elapsed_s"] = time.perf_counter() - started
    return report, status


def _workload(args: argparse.Namespace) -> tuple[list[Any], str] | None:
    """--workload's requests with their arrival times, and its description; None without it."""
    from appliance.bench.cli import build_workload, workload_args
    from appliance.sim import whatif

    if args.workload is None:
        if args.file is not None:
            raise ValueError("--file is only used with --workload jsonl")
        return None
    requests, description = build_workload(workload_args(**vars(args)))
    return whatif.workload_requests(requests, args.rate, args.seed), description


def _fit(db: str, run: Any, args: argparse.Namespace) -> Any:
    from appliance.sim import whatif
    from appliance.sim.records import load_run

    if args.fit_run is not None:
        source = load_run(db, args.fit_run)
        if source.key != run.key:
            raise ValueError(f"--fit-run {args.fit_run}: recorded on another engine ({source.key}) than run "
                             f"{run.run_id} ({run.key})")
        return whatif.fit_for_run(db, source, refit=args.refit)
    if args.fit_last is not None:
        now = time.time()
        return whatif.fit_for_run(db, run, since=now - args.fit_last, until=now)
    return whatif.fit_for_run(db, run, refit=args.refit)


# ---------------------------------------------------------------------------------------- views


def run_view(run: Any) -> dict[str, Any]:
    """A RecordedRun as JSON (the reports of `appliance simulate --json` and POST /admin/simulate)."""
    return {"run_id": run.run_id, "name": run.name, "replica_id": run.replica_id, "requests": len(run.requests),
            "arrival": run.arrival, "knobs": run.knobs.as_dict(), "num_blocks": run.cache.num_blocks,
            "block_size": run.cache.block_size, "max_model_len": run.cache.max_model_len,
            "engine": str(run.key), "knob_changes": run.knob_changes}


def model_view(model: Any) -> dict[str, Any]:
    """A StepTimeModel as JSON: coefficients, held-out error, the window it was fitted on and the
    spread of step times around it."""
    return {"id": model.id, "method": model.method, "coefficients": model.coefficients, "gap_s": model.gap_s,
            "heldout_mape": model.heldout_mape, "heldout_mae_s": model.heldout_mae_s, "rows_used": model.rows_used,
            "rows_held_out": model.rows_held_out, "replica_id": model.replica_id, "run_id": model.run_id,
            "window_start": model.window_start, "window_end": model.window_end, "engine": str(model.key),
            "spread_p10_p90": [model.ratio(0.1), model.ratio(0.9)] if model.noise else None}


def spread_text(model: dict[str, Any]) -> str:
    """How much the fitted iterations' step times vary around the fit (model_view's spread)."""
    if not model.get("spread_p10_p90"):
        return ""
    low, high = model["spread_p10_p90"]
    return f"; step times vary {low:.2f}x-{high:.2f}x around it (p10-p90, drawn per replayed iteration)"


def _slo_view(slo: SLO | None) -> dict[str, float] | None:
    return None if slo is None else slo.as_dict()


def outcome_view(o: Any) -> dict[str, Any]:
    """An Outcome as JSON: its knobs, summary and timeline (or why it was skipped)."""
    out: dict[str, Any] = {"label": o.label, "skipped": o.skipped}
    if o.scenario is not None:
        out.update(changes=o.scenario.changes, knobs=o.scenario.knobs.as_dict(), num_blocks=o.scenario.cache.num_blocks)
    if o.result is not None:
        out["summary"] = o.result.summary.as_dict()
        out["timeline"] = timeline(o.result.iterations)
    return out


def _fleet_view(p: Any) -> dict[str, Any]:
    return {"replicas": p.replicas, "attainment": p.attainment, "summary": p.summary.as_dict()}


def timeline(iterations: Sequence[Any], points: int = 300) -> dict[str, list[float]]:
    """Running, waiting, KV usage and preemptions over time (every k-th iteration), of replayed
    IterationStats (virtual time) or of a run's stored iteration rows (mappings, wall time)."""
    get = (lambda it, name: it[name]) if iterations and isinstance(iterations[0], Mapping) else getattr
    step = max(1, -(-len(iterations) // points))
    picked = iterations[::step]
    return {"t": [get(it, "started_at") for it in picked], "running": [get(it, "running") for it in picked],
            "waiting": [get(it, "waiting") for it in picked],
            "kv_usage": [get(it, "kv_blocks_used") / get(it, "kv_blocks_total") for it in picked],
            "preemptions": [sum(get(x, "preemptions") for x in iterations[i:i + step])
                            for i in range(0, len(iterations), step)]}


# ------------------------------------------------------------------------------------- printing


def _cell(label: str, value: float | None) -> str:
    if label == "tok/s":
        return "-" if value is None else f"{value:.1f}"
    return ms_text(value, unit="")


def _row(name: str, summary: dict[str, Any] | None, goodput: bool) -> str:
    if summary is None:
        return f"{name:<44}" + "(no recorded summary)"
    cells = [_cell(label, get(summary)) for label, get in METRICS]
    if goodput:
        cells.append("-" if summary.get("goodput") is None else f"{summary['goodput']:.2f}")
    return f"{name[:43]:<44}" + "".join(f"{c:>10}" for c in cells)


def format_report(report: dict[str, Any]) -> str:
    """The report as plain text: run, model, then one row per setting (latencies in ms)."""
    run, model = report["run"], report["model"]
    lines = [
        f"Run {run['run_id']}  {run['name']}  ({run['requests']} requests, {run['engine']})",
        f"Step-time model #{model['id']}: {model['method']}, held-out error {model['heldout_mape'] * 100:.1f} % "
        f"(MAE {model['heldout_mae_s'] * 1000:.2f} ms) on {model['rows_held_out']} of "
        f"{model['rows_used'] + model['rows_held_out']} iterations of replica {model['replica_id']}, "
        f"{_when(model['window_start'])} to {_when(model['window_end'])}{spread_text(model)}",
    ]
    if run["knob_changes"]:
        lines.append(f"Note: {run['knob_changes']} knob change(s) during the run; replayed at its starting knobs")
    goodput = report["slo"] is not None
    slo = ",".join(f"{k}={v * 1000:g}ms" for k, v in (report["slo"] or {}).items())
    header = f"{'':<44}" + "".join(f"{label:>10}" for label, _ in METRICS) + (f"{'goodput':>10}" if goodput else "")
    if "fleet" in report:
        fleet = report["fleet"]
        lines.append(f"Fleet at {fleet['rate']:g} req/s ({fleet['requests']} requests, {fleet['setting']}), "
                     f"latencies in ms" + (f", SLO {slo}" if goodput else ""))
        lines.append(header + f"{'in SLO':>10}")
        for p in fleet["points"]:
            share = "-" if p["attainment"] is None else f"{p['attainment'] * 100:.0f} %"
            lines.append(_row(f"{p['replicas']} replica(s)", p["summary"], goodput) + f"{share:>10}")
        if "attainment" in fleet:
            best = fleet["recommended"]
            lines.append(f"Fewest replicas holding {fleet['attainment']:.0%} within the SLO: "
                         + (str(best) if best is not None else f"none up to {len(fleet['points'])}"))
    else:
        lines.append("Latencies in ms" + (f"; SLO {slo}" if goodput else ""))
        lines.append(header)
        if "workload" in report:
            lines.append(f"Workload: {report['workload']}")
        else:
            lines.append(_row("recorded (measured)", report["recorded"], goodput))
        for i, o in enumerate(report["outcomes"]):
            name = ("simulated at the recorded knobs" if i == 0 else o["label"])
            lines.append(f"{name[:43]:<44}skipped: {o['skipped']}" if o["skipped"] else _row(name, o["summary"], goodput))
    lines.append(f"({report['elapsed_s']:.2f} s)")
    return "\n".join(lines)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
