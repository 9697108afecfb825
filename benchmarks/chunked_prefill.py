"""Chunked prefill on vs off, side by side from ONE server run.

The long-prompt-burst workload (short requests decoding when a burst of long prompts arrives)
is sent once per setting and round, the setting switched live between sends (PATCH
/admin/knobs, no restart), alternating on/off then off/on so drift hits both alike:

  on   long_prefill_token_threshold=256,   max_num_batched_tokens=2048 (chunks of 256)
  off  long_prefill_token_threshold=2048,  max_num_batched_tokens=2048 (a whole prompt at once)

Prints the decode ITL (gaps between tokens of the short, decoding requests) P50/P99 per
setting, the P99 drop with chunking (target >= 40 %), and the output throughput ratio (target
within 10 %). Starts its own `appliance serve` on 127.0.0.1 and stops it by PID.

    .venv/bin/python benchmarks/chunked_prefill.py [--num-requests 32] [--rounds 2]
    .venv/bin/python benchmarks/chunked_prefill.py -n 12 --num-long 2 --short-output-len 24,48 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

from bench_server import appliance_server, patch_knobs

from appliance.bench.loadgen import LoadGenerator
from appliance.bench.metrics import percentile
from appliance.bench.report import render_report
from appliance.bench.runner import BenchmarkRun, run_benchmark
from appliance.bench.workloads import BenchRequest, long_prompt_burst

BUDGET = 2048
SETTINGS = {
    "on": {"long_prefill_token_threshold": 256, "max_num_batched_tokens": BUDGET},
    "off": {"long_prefill_token_threshold": BUDGET, "max_num_batched_tokens": BUDGET},
}
ITL_DROP_TARGET = 0.40
THROUGHPUT_TOLERANCE = 0.10


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", "-n", type=int, default=32)
    parser.add_argument("--num-long", type=int, default=None, help="long prompts in the burst (default n // 8)")
    parser.add_argument("--long-prompt-len", type=int, default=1024)
    parser.add_argument("--short-output-len", type=_range, default=(64, 128), help="LO,HI tokens")
    parser.add_argument("--rounds", type=int, default=2, help="on/off pairs, alternating the order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default=None, help="passed to appliance serve")
    parser.add_argument("--device", default=None, help="passed to appliance serve")
    parser.add_argument("--report", default=None, help="also write the HTML report of every run here")
    args = parser.parse_args()

    requests = long_prompt_burst(args.num_requests, args.seed, num_long=args.num_long,
                                 long_prompt_len=args.long_prompt_len, short_output_len=args.short_output_len)
    num_long = args.num_long or max(1, args.num_requests // 8)
    shorts = set(range(len(requests) - num_long))  # the workload lists the long prompts last
    serve = ["--max-num-seqs", "64", "--max-num-batched-tokens", str(BUDGET),
             "--long-prefill-token-threshold", "256", "--max-num-partial-prefills", "1",
             "--max-long-partial-prefills", "1", "--num-blocks", str(_blocks(requests)),
             "--max-model-len", str(max(2048, args.long_prompt_len + 64))]
    for flag in ("dtype", "device"):
        if getattr(args, flag):
            serve += [f"--{flag}", getattr(args, flag)]
    runs: dict[str, list[BenchmarkRun]] = {"on": [], "off": []}
    with appliance_server(*serve) as (url, db):
        asyncio.run(LoadGenerator(requests[:1], base_url=url).run())  # warm up
        for rnd in range(args.rounds):
            for setting in ("on", "off") if rnd % 2 == 0 else ("off", "on"):
                patch_knobs(url, SETTINGS[setting])
                generator = LoadGenerator(requests, base_url=url)
                run = asyncio.run(run_benchmark(generator, workload=f"long-prompt-burst n={len(requests)}",
                                                name=f"chunked prefill {setting} (round {rnd + 1})", db_url=db))
                s = run.load.summary
                print(f"round {rnd + 1} {setting:>3}: {s.completed}/{s.num_requests} ok in {s.duration_s:.1f}s, "
                      f"{s.output_throughput:.1f} tok/s, ITL p99 {_ms(s.itl.p99)}", file=sys.stderr)
                runs[setting].append(run)
        if args.report:
            ids = [r.run_id for setting in ("on", "off") for r in runs[setting]]
            Path(args.report).write_text(render_report(db, ids, "html"), encoding="utf-8")
    print(_table(runs, shorts, requests))
    return 0


def _blocks(requests: list[BenchRequest], block_size: int = 16) -> int:
    """KV blocks for every request resident at once, with a little headroom."""
    tokens = sum(-(-(r.prompt_len + r.output_len) // block_size) for r in requests)
    return math.ceil(tokens * 1.1) + 16


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _figures(runs: list[BenchmarkRun], shorts: set[int], long_indexes: set[int]) -> dict[str, float | None]:
    gaps = [g for run in runs for r in run.load.results if r.ok and r.index in shorts for g in r.itl]
    long_ttft = [r.ttft for run in runs for r in run.load.results
                 if r.ok and r.index in long_indexes and r.ttft is not None]
    output = sum(run.load.summary.total_output_tokens for run in runs)
    duration = sum(run.load.summary.duration_s for run in runs)
    failed = sum(run.load.summary.failed + run.load.summary.not_sent for run in runs)
    return {
        "itl_p50": percentile(gaps, 50) if gaps else None,
        "itl_p99": percentile(gaps, 99) if gaps else None,
        "gaps": len(gaps),
        "throughput": output / duration if duration else None,
        "long_ttft_p99": percentile(long_ttft, 99) if long_ttft else None,
        "failed": failed,
    }


def _table(runs: dict[str, list[BenchmarkRun]], shorts: set[int], requests: list[BenchRequest]) -> str:
    longs = set(range(len(requests))) - shorts
    fig = {s: _figures(runs[s], shorts, longs) for s in ("on", "off")}
    lines = [f"{'chunked prefill':<16}{'chunk':>7}{'budget':>8}{'runs':>6}{'gaps':>7}{'decode ITL p50':>16}"
             f"{'decode ITL p99':>16}{'output tok/s':>14}{'long TTFT p99':>15}{'failed':>8}"]
    for s in ("on", "off"):
        f = fig[s]
        lines.append(f"{s:<16}{SETTINGS[s]['long_prefill_token_threshold']:>7}{BUDGET:>8}{len(runs[s]):>6}"
                     f"{f['gaps']:>7}{_ms(f['itl_p50']):>16}{_ms(f['itl_p99']):>16}"
                     f"{(f['throughput'] or 0):>14.1f}{_ms(f['long_ttft_p99']):>15}{f['failed']:>8}")
    on, off = fig["on"], fig["off"]
    if on["itl_p99"] and off["itl_p99"] and on["throughput"] and off["throughput"]:
        drop = 1 - on["itl_p99"] / off["itl_p99"]
        ratio = on["throughput"] / off["throughput"]
        lines.append("")
        lines.append(f"decode ITL p99 drop with chunking: {drop:.1%} (target >= {ITL_DROP_TARGET:.0%}: "
                     f"{'met' if drop >= ITL_DROP_TARGET else 'NOT met'})")
        lines.append(f"output throughput on/off: {ratio:.3f} (target within {THROUGHPUT_TOLERANCE:.0%}: "
                     f"{'met' if abs(ratio - 1) <= THROUGHPUT_TOLERANCE else 'NOT met'})")
    lines.append("runs: " + ", ".join(f"{s} {r.run_id}" for s in ("on", "off") for r in runs[s]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
