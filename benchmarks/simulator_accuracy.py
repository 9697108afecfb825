"""How well `appliance simulate` predicts a knob change, measured side by side in one script.

1. Start `appliance serve` (its own store), run the workload once at A to warm the server up
   (its first run after start is slower: first-time allocations, packing, kernel loads; not
   fitted, not compared), then set knobs A and record the workload once.
2. Fit the step-time model on that run's iterations (appliance.sim), and predict the workload at A
   and at the other settings by replay (no traffic).
3. Measure every setting live --repeats times (default 3), alternating (A B C D E F, then
   F E D C B A, then A B C D E F ...) so drift hits all alike, and print per metric: the
   prediction's absolute percentage error against the mean of the live runs, beside their
   run-to-run spread (max - min) / mean.
4. The model's step-time error on every live run's own iterations is printed as "step drift"
   (recorded / predicted step seconds): when the machine's speed moved between the fit and a
   measurement, it says so, and the "refit" column gives the error of a prediction made from a
   model refitted on the live run measured just before it (a window next to the measurement).
5. Mean errors over the settings three ways: fitted at A; refitted next to each measurement; and
   refitted only where the speed moved by more than DRIFT_NOTE (else fitted at A), the protocol
   of issue 13 ("refit on a window next to the measurement when machine speed drifts").

Also prints the replay speed: a 200-request replay, and a 50-point simulated sweep of it.

    .venv/bin/python benchmarks/simulator_accuracy.py [-n 24] [--max-output 64] [--rate 2] [--repeats 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

from bench_server import patch_knobs, server_process

from appliance.bench.loadgen import LoadGenerator
from appliance.bench.report.data import wait_for_server_rows
from appliance.bench.runner import BenchmarkRun, run_benchmark
from appliance.bench.workloads import skewed
from appliance.sim import whatif
from appliance.sim.fit import StepTimeModel, composition_of
from appliance.sim.records import iteration_rows, load_run
from appliance.sim.replay import replay

# Prefix caching off: every run sends the same prompts, so with it on every run after the first
# would be served ~90 % from the cache while a workload's replay (which knows no recorded hits)
# computes every prompt; off, every run computes its prompts and the fit sees real prefill.
BASE = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "long_prefill_token_threshold": 128,
        "max_num_partial_prefills": 1, "max_long_partial_prefills": 1, "scheduling_policy": "continuous",
        "enable_prefix_caching": False}
SETTINGS = {  # changes from A
    "A": {},
    "seqs=4": {"max_num_seqs": 4},
    "seqs=48,budget=512": {"max_num_seqs": 48, "max_num_batched_tokens": 512},
    "budget=64,chunk=32": {"max_num_batched_tokens": 64, "long_prefill_token_threshold": 32},
    "chunk=32,partial=2": {"long_prefill_token_threshold": 32, "max_num_partial_prefills": 2},
    "policy=static": {"scheduling_policy": "static"},
}
METRICS = {
    "throughput": lambda s: s.output_throughput,
    "E2E p50": lambda s: s.e2e.p50, "TTFT p50": lambda s: s.ttft.p50, "ITL p50": lambda s: s.itl.p50,
    "TTFT p99": lambda s: s.ttft.p99, "ITL p99": lambda s: s.itl.p99, "E2E p99": lambda s: s.e2e.p99,
}
TARGETS = {"throughput": 0.05, "E2E p50": 0.05, "TTFT p50": 0.10, "ITL p50": 0.10,
           "TTFT p99": 0.15, "ITL p99": 0.15, "E2E p99": 0.15}
DRIFT_NOTE = 0.05  # step drift beyond this is called out: a speed change the size of the tightest target (5 %)


def measure(base_url: str, db: str, requests: list, rate: float, seed: int, name: str) -> BenchmarkRun:
    patch_knobs(base_url, {**BASE, **SETTINGS[name]})
    generator = LoadGenerator(requests, base_url=base_url, rate=rate, seed=seed)
    run = asyncio.run(run_benchmark(generator, workload="skewed", name=name, db_url=db))
    wait_for_server_rows(db, run.run_id, run.load.summary.completed, timeout_s=30)
    s = run.load.summary
    print(f"  measured {name:<22} {s.output_throughput:7.1f} tok/s  TTFT p50 {s.ttft.p50 * 1000:7.1f} ms  "
          f"E2E p50 {s.e2e.p50 * 1000:7.1f} ms", file=sys.stderr, flush=True)
    return run


def step_drift(db: str, run: BenchmarkRun, model: StepTimeModel) -> float:
    """Recorded / predicted step seconds over a live run's iterations."""
    rows = [r for r in iteration_rows(db, run.load.replica_id, run.load.started_at, run.load.finished_at)
            if r["decode_context_tokens"] is not None]
    recorded = sum(r["duration_s"] for r in rows)
    return recorded / sum(model.expected(composition_of(r)) for r in rows)


def predict(model: StepTimeModel, base_run: Any, requests: list, rate: float, seed: int, name: str):
    s = whatif.scenario(base_run.knobs, base_run.cache, {**BASE, **SETTINGS[name]})
    return replay(whatif.workload_requests(requests, rate, seed), s.knobs, s.cache, model).summary


def ape(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return abs(predicted - measured) / measured


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--num-requests", type=int, default=24, help="skewed requests per run")
    parser.add_argument("--max-output", type=int, default=64, help="cap on each request's output length")
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="live runs of each setting (at least 2)")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error(f"--repeats {args.repeats}: each setting is measured at least twice")
    requests = [replace(r, output_len=min(r.output_len, args.max_output)) for r in skewed(64, 0)[: args.num_requests]]

    with server_process("--dtype", args.dtype, "--max-num-seqs", "64", "--max-num-batched-tokens", "512") as srv:
        db = srv.db_url
        print("warming up at A ...", file=sys.stderr, flush=True)
        measure(srv.base_url, db, requests, args.rate, args.seed, "A")
        print("recording A ...", file=sys.stderr, flush=True)
        recorded = measure(srv.base_url, db, requests, args.rate, args.seed, "A")
        base_run = load_run(db, recorded.run_id)
        model = whatif.fit_for_run(db, base_run)
        print(f"fitted on {model.rows_used + model.rows_held_out} iterations: {model.method}, held-out error "
              f"{model.heldout_mape * 100:.1f} %, gap {model.gap_s * 1000:.2f} ms", file=sys.stderr, flush=True)
        predicted = {name: predict(model, base_run, requests, args.rate, args.seed, name) for name in SETTINGS}
        order = [name for i in range(args.repeats) for name in (list(SETTINGS) if i % 2 == 0 else reversed(SETTINGS))]
        live: dict[str, list[BenchmarkRun]] = {name: [] for name in SETTINGS}
        refit: dict[str, list[Any]] = {name: [] for name in SETTINGS}
        drift: dict[str, list[float]] = {name: [] for name in SETTINGS}
        previous = recorded
        for name in order:
            neighbour = whatif.fit_for_run(db, load_run(db, previous.run_id), store=False)
            refit[name].append(predict(neighbour, base_run, requests, args.rate, args.seed, name))
            run = measure(srv.base_url, db, requests, args.rate, args.seed, name)
            live[name].append(run)
            drift[name].append(step_drift(db, run, model))
            previous = run

    print(f"\nsimulator accuracy: skewed n={args.num_requests} (outputs <= {args.max_output}) at Poisson {args.rate:g}/s, {args.dtype}; fitted "
          f"on one run at A ({model.rows_used + model.rows_held_out} iterations, held-out step error "
          f"{model.heldout_mape * 100:.1f} %); A = {BASE}")
    print(f"APE % = |predicted - mean of {args.repeats} live runs| / mean; spread % = (max - min of the live "
          "runs) / mean; refit % = APE of the mean prediction from models refitted on the run measured just "
          "before each\n")
    lives = "".join(f"{f'live {i + 1}':>10}" for i in range(args.repeats))
    header = (f"{'setting':<22}{'metric':<12}{'predicted':>11}{lives}"
              f"{'APE %':>8}{'spread %':>10}{'refit %':>9}{'target %':>10}")
    print(header)
    worst: dict[str, list[float]] = {m: [] for m in METRICS}
    refitted: dict[str, list[float]] = {m: [] for m in METRICS}
    protocol: dict[str, list[float]] = {m: [] for m in METRICS}  # refitted where the speed moved, else fitted at A
    for name in SETTINGS:
        drifted = any(abs(x - 1) > DRIFT_NOTE for x in drift[name])
        for metric, get in METRICS.items():
            p = get(predicted[name])
            measured = [get(r.load.summary) for r in live[name]]
            mean = statistics.fmean(measured)
            error = ape(p, mean)
            refit_mean = statistics.fmean(get(s) for s in refit[name])
            scale = 1 if metric == "throughput" else 1000
            print(f"{name:<22}{metric:<12}{p * scale:>11.1f}" + "".join(f"{m * scale:>10.1f}" for m in measured)
                  + f"{pct(error):>8}{pct((max(measured) - min(measured)) / mean):>10}{pct(ape(refit_mean, mean)):>9}"
                  f"{TARGETS[metric] * 100:>10.0f}")
            if error is not None:
                worst[metric].append(error)
            if (refit_error := ape(refit_mean, mean)) is not None:
                refitted[metric].append(refit_error)
            if (chosen := refit_error if drifted else error) is not None:
                protocol[metric].append(chosen)
        d = drift[name]
        note = "  <- the machine's speed moved since the fit" if drifted else ""
        print(f"{name:<22}{'step drift':<12}{'':>11}" + "".join(f"{x:>10.2f}" for x in d) + note)
    for label, errors in (("fitted at A", worst), ("refitted next to each measurement", refitted),
                          ("refitted where the machine's speed moved, else fitted at A", protocol)):
        print(f"\nmean APE per metric over the settings, {label}: " + ", ".join(
            f"{m} {statistics.fmean(v) * 100:.1f} %{'' if statistics.fmean(v) <= TARGETS[m] else ' (over target)'}"
            for m, v in errors.items() if v))

    many = whatif.resample(whatif.workload_requests(requests, args.rate, args.seed), 200, args.rate, args.seed)
    t0 = time.perf_counter()
    replay(many, base_run.knobs, base_run.cache, model)
    one = time.perf_counter() - t0
    grid = whatif.grid_scenarios(base_run.knobs, base_run.cache, {
        "max_num_seqs": [4, 8, 16, 32, 64], "max_num_batched_tokens": [128, 256, 512, 1024, 2048],
        "long_prefill_token_threshold": [32, 128]})
    t0 = time.perf_counter()
    points = [replay(many, s.knobs, s.cache, model) for _, s in grid if not isinstance(s, str)]
    swept = time.perf_counter() - t0
    live_min = sum(p.duration_s for p in points) / 60
    print(f"speed: a 200-request replay in {one:.2f} s; a {len(points)}-point simulated sweep of the same "
          f"200 requests in {swept:.1f} s (the same grid live: {live_min:.0f} min of traffic at least)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
