"""The same skewed requests, all at once, three ways in ONE run (not a test; prints figures):

1. in-process: `LLMEngine` with exactly the settings `appliance serve` resolves (same dtype,
   knobs, cache), stepped in this process
2. served: `appliance serve` (a subprocess, telemetry on, as a user runs it) loaded by
   `appliance bench` (another subprocess: streaming completions, forced lengths, all at t=0)
3. transformers' continuous batching (`ContinuousBatchingManager`) on the same prompts and lengths

Output tok/s counts forced output tokens over the wall time from the first request to the last
completion. Served/in-process and served/transformers are printed as ratios.

    python benchmarks/served_vs_inprocess.py [--dtype float32] [--num-requests 48] [--skip-peers]
"""

from __future__ import annotations

import argparse
import json
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
    return tokens / (time.perf_counter() - t0)


def served(dtype: str, num_requests: int) -> float:
    with server_process("--dtype", dtype) as server:
        bench = [sys.executable, "-m", "appliance.cli", "bench", "--base-url", server.base_url, "--workload", "skewed",
                 "--num-requests", str(num_requests), "--json"]
        warm = [*bench[:-3], "--num-requests", "2", "--json"]
        subprocess.run(warm, cwd=ROOT, check=True, capture_output=True, text=True)
        done = subprocess.run(bench, cwd=ROOT, check=True, capture_output=True, text=True)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return summary["summary"]["output_throughput"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--skip-peers", action="store_true", help="no transformers row")
    args = ap.parse_args()
    requests = skewed(args.num_requests, 0)
    print(f"skewed-{args.num_requests}: {sum(r.output_len for r in requests)} forced output tokens, "
          f"{args.dtype}, all at once, the server's default knobs", flush=True)
    loaded = load_model(dtype=args.dtype, device="cpu")
    freeze_heap()  # as `appliance serve` does: no full collection of the model's objects in a timed step
    rows = {"in-process engine": in_process(loaded, args.dtype, requests)}
    print(f"{'in-process engine':36s} {rows['in-process engine']:8.1f} tok/s", flush=True)
    rows["served (appliance bench -> serve)"] = served(args.dtype, args.num_requests)
    print(f"{'served (appliance bench -> serve)':36s} {rows['served (appliance bench -> serve)']:8.1f} tok/s", flush=True)
    if not args.skip_peers:
        hf = run_hf_continuous(loaded, [{"prompt_ids": r.prompt_ids, "output_len": r.output_len} for r in requests])
        rows["transformers continuous batching"] = hf["tok_s"]
        print(f"{'transformers continuous batching':36s} {hf['tok_s']:8.1f} tok/s", flush=True)
    s = rows["served (appliance bench -> serve)"]
    print(f"served / in-process = {s / rows['in-process engine']:.2f}", end="")
    if "transformers continuous batching" in rows:
        print(f", served / transformers CB = {s / rows['transformers continuous batching']:.2f}", end="")
    print()


if __name__ == "__main__":
    main()
