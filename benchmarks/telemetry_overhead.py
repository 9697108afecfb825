"""Does telemetry slow the engine? Skewed-64 with the SQLite writer on and off, alternating, in
one run (target: throughput loss <= 2 %). Then the writer soak of 1,000,000 synthetic rows
(benchmarks/telemetry_writer_soak.py): rows/s written and the one-hour, 500-point query time.

    python benchmarks/telemetry_overhead.py [--rounds 2] [--dtype float32] [--soak-rows 1000000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from appliance.engine import EngineConfig, Knobs, LLMEngine, SamplingParams
from appliance.model_loader import load_model
from appliance.telemetry import store
from appliance.telemetry.writer import TelemetryWriter

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE.parent / "appliance" / "bench" / "data" / "skewed-64.json"


def one_pass(loaded, requests, db_url: str | None) -> tuple[float, int]:
    engine = LLMEngine(EngineConfig(dtype=str(loaded.dtype).split(".")[-1], knobs=Knobs(max_num_seqs=64)), loaded=loaded)
    writer = None
    if db_url:
        writer = TelemetryWriter(db_url, replica_id="overhead")
        writer.start()
        engine.add_sink(writer)
    t0 = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(str(i), r["prompt_ids"], SamplingParams(max_tokens=r["output_len"], temperature=0, ignore_eos=True))
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    wall = time.perf_counter() - t0
    if writer:
        writer.close(timeout=10)
    return tokens / wall, engine.iteration


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--soak-rows", type=int, default=1_000_000)
    args = ap.parse_args()
    loaded = load_model(dtype=args.dtype, device="cpu")
    requests = json.loads(WORKLOAD.read_text())["requests"]
    folder = tempfile.mkdtemp(prefix="telemetry-overhead-")
    url = f"sqlite:///{folder}/appliance.db"
    store.upgrade(url)
    on, off = [], []
    for rnd in range(args.rounds):
        for label, target in (("off", None), ("on", url)) if rnd % 2 == 0 else (("on", url), ("off", None)):
            rate, iters = one_pass(loaded, requests, target)
            (on if label == "on" else off).append(rate)
            print(f"round {rnd + 1} telemetry {label:3s}: {rate:7.1f} output tok/s over {iters} iterations")
    mean_on, mean_off = sum(on) / len(on), sum(off) / len(off)
    loss = 100 * (1 - mean_on / mean_off)
    print(f"\nmean with telemetry {mean_on:.1f} tok/s, without {mean_off:.1f} tok/s: loss {loss:.2f} % (target <= 2 %)")
    print("\n== writer soak ==")
    subprocess.run([sys.executable, str(HERE / "telemetry_writer_soak.py"), "--rows", str(args.soak_rows)], check=True)


if __name__ == "__main__":
    main()
