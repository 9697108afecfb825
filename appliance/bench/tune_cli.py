"""`appliance tune`: sweep the knobs of a running appliance (appliance.bench.tune).

Exit status: 0 when a setting met the SLO (and was applied with --apply), 1 when none did, 2
when the sweep could not run.
"""

from __future__ import annotations

import argparse
import os
import sys

import httpx

from appliance.bench.cli import API_KEY_ENV, add_workload_arguments, build_workload, db_url
from appliance.bench.loadgen import BenchError, normalize_base_url
from appliance.bench.report.cli import FORMAT_CHOICES, format_for, write_output
from appliance.bench.report.sweep import render_sweep, summary_lines
from appliance.bench.tune import DEFAULT_ATTAINMENT, TUNED, Grid, run_sweep

GRID_FLAGS = {"max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
              "long_prefill_token_threshold": "--chunk-sizes"}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _share(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be within (0, 1], got {text}")
    return value


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    """The `appliance tune` flags (the workload flags are `appliance bench`'s)."""
    add_workload_arguments(parser)
    default = Grid()
    for name in TUNED:
        values = ",".join(str(v) for v in getattr(default, name))
        parser.add_argument(GRID_FLAGS[name], dest=name, type=_int_list, default=getattr(default, name),
                            help=f"coarse grid values of {name} (default {values})")
    parser.add_argument("--no-refine", action="store_true", help="skip the refinement around the best point")
    parser.add_argument("--attainment", type=_share, default=DEFAULT_ATTAINMENT,
                        help=f"share of requests that must meet the SLO (default {DEFAULT_ATTAINMENT})")
    parser.add_argument("--apply", action="store_true",
                        help="leave the recommended setting on the server (default: restore the original knobs)")
    parser.add_argument("--report", default=None, help="write the sweep report here (.html, .md, .csv or .json)")
    parser.add_argument("--format", choices=FORMAT_CHOICES, default=None,
                        help="report format (default: from --report's suffix, else html)")
    parser.add_argument("--simulate", default=None, metavar="RUN_ID",
                        help="rank the whole grid in simulation (step times fitted on this recorded run of the "
                             "same engine), then measure only the top --verify points live")
    parser.add_argument("--verify", type=_positive, default=3, help="points to measure live with --simulate (default 3)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _simulated_points(args: argparse.Namespace, requests: list, grid: Grid) -> tuple[list, dict]:
    """`--simulate`: the grid ranked by replay; returns the top --verify knob sets and the
    predictions of every ranked point, by label."""
    from appliance.sim import whatif
    from appliance.sim.fit import EngineKey
    from appliance.sim.rank import SLOWER, rank_grid
    from appliance.sim.records import load_run

    run = load_run(db_url(args.db), args.simulate)
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        view = httpx.get(f"{normalize_base_url(args.base_url)}/admin/knobs", headers=headers, timeout=30).json()
        server = EngineKey.from_fixed(view["fixed"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"--simulate needs the appliance's GET /admin/knobs: {exc}") from None
    if server != run.key:
        raise ValueError(f"--simulate {args.simulate}: recorded on {run.key}, but the server runs {server}")
    model = whatif.fit_for_run(db_url(args.db), run)
    sim_requests = whatif.workload_requests(requests, args.rate, args.seed)
    ranked, invalid = rank_grid(run, model, grid.points(), sim_requests, args.slo, args.attainment, args.concurrency)
    if not ranked:
        raise ValueError(f"no valid point in the grid: {invalid[0][1] if invalid else 'empty grid'}")
    print(f"ranked {len(ranked)} grid points in simulation at the step-time model's times and {SLOWER:g}x them "
          f"(its held-out error {model.heldout_mape * 100:.1f} %); measuring the top {min(args.verify, len(ranked))} live",
          file=sys.stderr, flush=True)
    return [p.knobs for p in ranked[: args.verify]], {_label(p.knobs): p.predicted for p in ranked}


def _label(knobs: dict) -> str:
    return ",".join(f"{k}={knobs[k]}" for k in TUNED)


def tune_main(args: argparse.Namespace) -> int:
    if args.slo is None:
        print("appliance tune: error: --slo is required, e.g. --slo ttft=500ms,tpot=100ms", file=sys.stderr)
        return 2
    try:
        requests, workload = build_workload(args)
        fmt = format_for(args.format, args.report)
        grid = Grid(**{name: getattr(args, name) for name in TUNED})
        points, predictions = _simulated_points(args, requests, grid) if args.simulate else (None, {})
        result = run_sweep(
            requests, args.slo, base_url=args.base_url, grid=grid, refine=not args.no_refine, apply=args.apply,
            attainment=args.attainment, rate=args.rate, concurrency=args.concurrency, seed=args.seed,
            max_duration_s=args.duration, request_timeout_s=args.request_timeout,
            api_key=args.api_key or os.environ.get(API_KEY_ENV), db_url=db_url(args.db), workload=workload,
            progress=lambda line: print(line, file=sys.stderr, flush=True), points=points,
        )
        for point in result.points:
            point.predicted = predictions.get(_label(point.knobs))
    except (ValueError, LookupError, FileNotFoundError, BenchError) as exc:
        print(f"appliance tune: error: {exc}", file=sys.stderr)
        return 2
    print(render_sweep(result, "md") if args.report is None else "\n".join(summary_lines(result)))
    if args.report is not None:
        try:
            write_output(render_sweep(result, fmt), args.report)
        except FileNotFoundError as exc:
            print(f"appliance tune: error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote the sweep report to {args.report}", file=sys.stderr)
    return 0 if result.recommendation is not None else 1

