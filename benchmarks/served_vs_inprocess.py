"""The same skewed requests, all at once, three ways in ONE run (not a test; prints figures):

1. in-process: `LLMEngine` with exactly the settings `appliance serve` resolves (same dtype,
   knobs, cache), stepped in this process
2. served: `appliance serve` (a subprocess, telemetry on, as a user runs it) loaded by
   `appliance bench` (another subprocess: streaming completions, forced lengths, all at t=0)
3. transformers' continuous batching (`ContinuousBatchingManager`) on the same prompts and lengths

Output tok/s counts forced output tokens over the wall time from the first request to the last
completion. Served/in-process and served/transformers are printed as ratios. One server starts
before the first round and idles while this process steps its engine. With `--rounds N` the
in-process and served runs alternate N times against that server, each round with prompts of its
own (seed 0, 1, ...: none in the server's prefix cache from an earlier round), each pair's ratio
and their median printed: on a shared machine whose speed moves 10-20 % from one minute to the
next, one pair's ratio says more about the minute than about serving.

    python benchmarks/served_vs_inprocess.py [--dtype float32] [--num-requests 48] [--skip-peers] [--rounds N]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_server import ROOT, server_process  # noqa: E402
from throughput import run_hf_continuous  # noqa: E402

from appliance.bench.workloads import skewed  # noqa: E402
from appliance.cli import build_parser  # noqa: E402
from appliance.engine import LLMEngine, SamplingParams  # noqa: E402
from appliance.model_loader import load_model  # noqa: E402
from appliance.server.cli import freeze_heap  # noqa: E402
from appliance.settings import engine_config_from_args  # noqa: E402


def in_process(loaded, dtype: str, requests) -> float:
    config = engine_config_from_args(build_parser().parse_args(["serve", "--dtype", dtype]))
    engine = LLMEngine(config, loaded=loaded)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))  # warm-up, as the server's first request
    t0 = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(str(i), r.prompt_ids, SamplingParams(max_tokens=r.output_len, min_tokens=r.output_len,
                                                                temperature=0, ignore_eos=True))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    tok_s = tokens / (time.perf_counter() - t0)
    del engine
    gc.collect()  # this round's engine and KV cache go before the next round's
    return tok_s


def served(base_url: str, num_requests: int, seed: int) -> float:
    """`appliance bench` (the skewed workload of `seed`) against the server at `base_url`: output tok/s."""
    bench = [sys.executable, "-m", "appliance.cli", "bench", "--base-url", base_url, "--workload", "skewed",
             "--num-requests", str(num_requests), "--seed", str(seed), "--json"]
    done = subprocess.run(bench, cwd=ROOT, check=True, capture_output=True, text=True)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return summary["summary"]["output_throughput"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--skip-peers", action="store_true", help="no transformers row")
    ap.add_argument("--rounds", type=int, default=1, help="in-process and served runs alternating, this many pairs")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    print(f"skewed-{args.num_requests} (seed 0{f' to {args.rounds - 1}, one a round' if args.rounds > 1 else ''}), "
          f"{args.dtype}, all at once, the server's default knobs", flush=True)
    loaded = load_model(dtype=args.dtype, device="cpu")
    freeze_heap()  # as `appliance serve` does: no full collection of the model's objects in a timed step
    ratios, serving, row = [], [], "{:44s} {:8.1f} tok/s"
    with server_process("--dtype", args.dtype) as server:
        served(server.base_url, 2, seed=args.rounds)  # warm-up, with prompts no round sends (no prefix cache hits)
        for round_ in range(args.rounds):
            label = f" (round {round_ + 1})" if args.rounds > 1 else ""
            requests = skewed(args.num_requests, round_)  # a round's own prompts: none cached by an earlier round
            engine = in_process(loaded, args.dtype, requests)
            print(row.format("in-process engine" + label, engine), flush=True)
            serving.append(served(server.base_url, args.num_requests, seed=round_))
            print(row.format("served (appliance bench -> serve)" + label, serving[-1]), flush=True)
            ratios.append(serving[-1] / engine)
    line = f"served / in-process = {', '.join(f'{r:.2f}' for r in ratios)}"
    if args.rounds > 1:
        line += f" (median {statistics.median(ratios):.2f})"
    if not args.skip_peers:
        hf = run_hf_continuous(loaded, [{"prompt_ids": r.prompt_ids, "output_len": r.output_len} for r in requests])
        print(row.format("transformers continuous batching", hf["tok_s"]), flush=True)
        line += f", served / transformers CB = {serving[-1] / hf['tok_s']:.2f}"  # the last round's prompts
    print(line)


if __name__ == "__main__":
    main()
