"""Static vs continuous batching, side by side from ONE server run.

Two workloads, each sent under continuous then static scheduling (switched live with PATCH
/admin/knobs by `appliance.bench.ab`, the same code as `appliance bench --ab`):

  skewed-64  the packaged long-tailed mix, all requests at once
  sharegpt   200 ShareGPT conversations at a Poisson --rate that loads the server

Prints each pair side by side with the static/continuous ratios of throughput and latency, and
the static run's padding share (rows of finished requests held in the batch, from the server's
ITERATION telemetry). Starts its own `appliance serve` on 127.0.0.1 and stops it by PID.

    .venv/bin/python benchmarks/static_vs_continuous.py [--rate 2] [--skewed-requests 64] [--sharegpt-requests 200]
    .venv/bin/python benchmarks/static_vs_continuous.py --num-requests 8 --max-output-len 48 --max-total-len 256

On a 2-core CPU the full size takes long: sharegpt-200 forces ~59,000 output tokens per policy.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys

from bench_server import appliance_server

from appliance.bench.ab import ABResult, format_ab, run_ab
from appliance.bench.loadgen import LoadGenerator
from appliance.bench.workloads import BenchRequest, sharegpt, skewed
from appliance.model_loader import load_tokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", "-n", type=int, default=None,
                        help="requests per workload (default: 64 skewed, 200 sharegpt)")
    parser.add_argument("--skewed-requests", type=int, default=None, help="skewed requests (overrides -n)")
    parser.add_argument("--sharegpt-requests", type=int, default=None, help="sharegpt requests (overrides -n)")
    parser.add_argument("--rate", type=float, default=2.0, help="sharegpt Poisson arrivals per second")
    parser.add_argument("--max-output-len", type=int, default=None, help="cap every forced output length")
    parser.add_argument("--max-total-len", type=int, default=2048, help="sharegpt prompt + reply filter")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", default="skewed,sharegpt", help="which to run: skewed, sharegpt or both")
    parser.add_argument("--request-timeout", type=float, default=3600.0,
                        help="seconds a request may wait for each part of its reply (default 3600: under "
                             "static batching a queued request can wait many minutes for its first token)")
    parser.add_argument("--dtype", default=None, help="passed to appliance serve")
    parser.add_argument("--device", default=None, help="passed to appliance serve")
    args = parser.parse_args()

    tokenizer = load_tokenizer(None)
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    n_skewed = args.skewed_requests or args.num_requests or 64
    n_sharegpt = args.sharegpt_requests or args.num_requests or 200
    workloads = {
        f"skewed-{n_skewed}": (skewed(n_skewed, args.seed), None),
        f"sharegpt-{n_sharegpt}": (
            sharegpt(n_sharegpt, args.seed, count, max_total_len=args.max_total_len,
                     max_prompt_len=min(1024, args.max_total_len // 2)), args.rate),
    }
    chosen = {w.strip() for w in args.workloads.split(",") if w.strip()}
    if not chosen or chosen - {"skewed", "sharegpt"}:
        parser.error(f"--workloads takes skewed, sharegpt or both, got {args.workloads!r}")
    workloads = {name: w for name, w in workloads.items() if name.split("-")[0] in chosen}
    if args.max_output_len:
        workloads = {name: ([dataclasses.replace(r, output_len=min(r.output_len, args.max_output_len))
                             for r in reqs], rate) for name, (reqs, rate) in workloads.items()}
    blocks = max(_blocks(reqs) for reqs, _ in workloads.values())
    longest = max((r.prompt_len or 0) + (r.output_len or 0) for reqs, _ in workloads.values() for r in reqs)
    serve = ["--max-num-seqs", "64", "--num-blocks", str(blocks), "--max-model-len", str(longest + 16)]
    for flag in ("dtype", "device"):
        if getattr(args, flag):
            serve += [f"--{flag}", getattr(args, flag)]
    results: dict[str, ABResult] = {}
    with appliance_server(*serve) as (url, db):
        asyncio.run(LoadGenerator(skewed(n_skewed, args.seed)[:1], base_url=url).run())  # warm up
        for name, (requests, rate) in workloads.items():
            def make(requests: list[BenchRequest] = requests, rate: float | None = rate) -> LoadGenerator:
                return LoadGenerator(requests, base_url=url, rate=rate, seed=args.seed,
                                     request_timeout_s=args.request_timeout)

            print(f"{name}: continuous, then static ...", file=sys.stderr)
            results[name] = asyncio.run(run_ab(make, workload=name, name=name, db_url=db))
    for name, result in results.items():
        arrival = "all at once" if workloads[name][1] is None else f"Poisson {workloads[name][1]:g}/s"
        print(f"\n== {name} ({len(workloads[name][0])} requests, {arrival})\n{format_ab(result)}")
    print("\nstatic / continuous" + "".join(f"{name:>22}" for name in results))
    for key, label in (("output_throughput", "output throughput"), ("request_throughput", "request throughput"),
                       ("ttft.p50", "TTFT p50"), ("ttft.p99", "TTFT p99"), ("tpot.p50", "TPOT p50"),
                       ("e2e.p50", "E2E p50"), ("e2e.p99", "E2E p99")):
        cells = "".join(f"{_ratio(r.ratio(key)):>22}" for r in results.values())
        print(f"{label:<19}{cells}")
    shares = [r.convoy.padding_share if r.convoy else None for r in results.values()]
    print(f"{'static padding':<19}" + "".join(f"{'-' if s is None else f'{s:.1%}':>22}" for s in shares))
    return 0


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _blocks(requests: list[BenchRequest], block_size: int = 16) -> int:
    """KV blocks for up to 64 of the longest requests resident at once, with headroom."""
    longest = sorted(((r.prompt_len or 0) + (r.output_len or 0) for r in requests), reverse=True)[:64]
    return math.ceil(sum(-(-t // block_size) for t in longest) * 1.1) + 16


if __name__ == "__main__":
    sys.exit(main())
