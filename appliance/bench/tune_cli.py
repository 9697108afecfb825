"""`appliance tune`: sweep the knobs of a running appliance (appliance.bench.tune).

Exit status: 0 when a setting met the SLO (and was applied with --apply), 1 when none did, 2
when the sweep could not run.
"""

from __future__ import annotations

import argparse
import os
import sys

from appliance.bench.cli import API_KEY_ENV, add_workload_arguments, build_workload, db_url
from appliance.bench.loadgen import BenchError
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


def tune_main(args: argparse.Namespace) -> int:
    if args.slo is None:
        print("appliance tune: error: --slo is required, e.g. --slo ttft=500ms,tpot=100ms", file=sys.stderr)
        return 2
    try:
        requests, workload = build_workload(args)
        fmt = format_for(args.format, args.report)
        grid = Grid(**{name: getattr(args, name) for name in TUNED})
        result = run_sweep(
            requests, args.slo, base_url=args.base_url, grid=grid, refine=not args.no_refine, apply=args.apply,
            attainment=args.attainment, rate=args.rate, concurrency=args.concurrency, seed=args.seed,
            max_duration_s=args.duration, request_timeout_s=args.request_timeout,
            api_key=args.api_key or os.environ.get(API_KEY_ENV), db_url=db_url(args.db), workload=workload,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except (ValueError, FileNotFoundError, BenchError) as exc:
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

