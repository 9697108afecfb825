"""What does Ray Serve cost? Skewed-64 against the plain single process and against a fleet of
one replica on Ray Serve (`--replicas 1`, the replica reserving every core), in alternating
rounds in one run; prints output tok/s of each round, the means and fleet/plain (target >= 0.9:
the router's and the ingress's cost). With --two-replicas, also a fleet of two replicas with one
torch thread each (`--replicas 2`) against the same plain process.

With --sizing, the what-if simulator's fleet answer against measured fleets: one plain server
with one torch thread (what each replica of a two-replica fleet gets on a 2-core box) records a
skewed run at Poisson --fit-rate to fit on, then serves the sizing workload (skewed at
--sizing-rate); `appliance simulate --run RUN --workload skewed --rate R --replicas N` predicts
one and two such replicas (and `--max-replicas 4 --slo ...` how many hold the SLO); then a fleet
of two one-thread replicas serves the same requests at the same arrival times. Prefix caching is
off throughout (the replayed workload knows no hits). Prints predicted and measured side by side.

Each server is started fresh for its round and stopped after it (only one runs at a time: they
would share the cores). This box is shared; run it at least twice.

    .venv/bin/python benchmarks/fleet.py [--num-requests 64] [--rounds 2] [--two-replicas] [--sizing]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys

from bench_server import ROOT, server_process

from appliance.bench.loadgen import LoadGenerator
from appliance.bench.metrics import Summary, parse_slo
from appliance.bench.workloads import skewed


def one_round(serve_args: list[str], requests) -> float:
    with server_process(*serve_args, ready_timeout_s=600.0) as server:
        result = asyncio.run(LoadGenerator(requests, base_url=server.base_url, seed=0).run())
    return result.summary.output_throughput


def appliance(*args: str) -> dict:
    """`appliance ARGS --json` in a subprocess; its JSON answer (exit 1 of a fleet sizing that
    found no fleet still answers)."""
    done = subprocess.run([sys.executable, "-m", "appliance.cli", *args, "--json"], cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode not in (0, 1) or not done.stdout.strip():
        raise RuntimeError(f"appliance {args[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def sizing(args: argparse.Namespace, base: list[str]) -> None:
    """The simulator's answer for one and two replicas (fitted on one one-thread server) against
    the same requests and arrival times measured on one one-thread server and on a fleet of two
    one-thread replicas. Prefix caching off throughout: the replayed workload knows no hits."""
    n, rate, seed, slo = args.num_requests, args.sizing_rate, 0, parse_slo(args.slo)
    base = [*base, "--no-enable-prefix-caching"]

    def measure(url: str) -> dict:
        load = LoadGenerator(skewed(n, seed), base_url=url, rate=rate, seed=seed, slo=slo)
        return summary_view(asyncio.run(load.run()).summary)

    measured = {}
    with server_process(*base, env={"OMP_NUM_THREADS": "1"}) as one:
        run = appliance("bench", "--base-url", one.base_url, "--db", one.db_url, "--workload", "skewed",
                        "--num-requests", str(args.fit_requests), "--rate", str(args.fit_rate), "--name", "fit")
        print(f"fit: one server, one torch thread, {args.fit_requests} skewed requests at {args.fit_rate:g}/s: "
              f"{run['summary']['output_throughput']:.1f} tok/s", flush=True)
        measured[1] = measure(one.base_url)
    question = ["simulate", "--db", one.db_url, "--run", run["run_id"], "--workload", "skewed", "--num-requests",
                str(n), "--rate", str(rate), "--seed", str(seed), "--slo", args.slo]
    predicted = {k: appliance(*question, "--replicas", str(k))["fleet"]["points"][0]["summary"] for k in (1, 2)}
    sized = appliance(*question, "--max-replicas", "4")["fleet"]
    with server_process(*base, "--replicas", "2", ready_timeout_s=600.0) as fleet:
        measured[2] = measure(fleet.base_url)
    print(f"\n{n} skewed requests at Poisson {rate:g}/s, SLO {args.slo}; one-thread replicas (a plain "
          "process for 1, Ray Serve for 2)")
    print(f"{'':22s} {'tok/s':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'E2E p50':>8s} {'E2E p99':>8s} {'in SLO':>7s}")
    for k in (1, 2):
        for label, row in (("predicted", predicted[k]), ("measured", measured[k])):
            print(f"{k} replica(s) {label:9s} {row['output_throughput']:8.1f} {row['ttft']['p50']:9.2f} "
                  f"{row['ttft']['p99']:9.2f} {row['e2e']['p50']:8.2f} {row['e2e']['p99']:8.2f} "
                  f"{(row['slo_met'] or 0) / row['num_requests']:7.1%}")
        p, m = predicted[k], measured[k]
        print(f"{k} replica(s) predicted / measured: " + ", ".join(
            f"{name} {p_value / m_value:.2f}x" for name, p_value, m_value in (
                ("tok/s", p["output_throughput"], m["output_throughput"]), ("TTFT p50", p["ttft"]["p50"], m["ttft"]["p50"]),
                ("TTFT p99", p["ttft"]["p99"], m["ttft"]["p99"]), ("E2E p50", p["e2e"]["p50"], m["e2e"]["p50"]),
                ("E2E p99", p["e2e"]["p99"], m["e2e"]["p99"]))))
    within = ", ".join(f"{pt['replicas']}: {pt['attainment']:.0%}" for pt in sized["points"])
    print(f"simulator's sizing (share within the SLO by fleet size): {within}; fewest holding "
          f"{sized['attainment']:.0%}: {sized['recommended'] or 'none up to 4'}; measured: "
          + ", ".join(f"{k}: {(m['slo_met'] or 0) / m['num_requests']:.0%}" for k, m in measured.items()))


def summary_view(summary: Summary) -> dict:
    return json.loads(json.dumps(summary.as_dict()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--two-replicas", action="store_true")
    ap.add_argument("--sizing", action="store_true", help="only the simulator's fleet answer vs a measured fleet")
    ap.add_argument("--sizing-rate", type=float, default=1.0, help="requests/s the measured fleet of two gets")
    ap.add_argument("--fit-rate", type=float, default=0.5, help="requests/s of the one-replica run fitted on")
    ap.add_argument("--fit-requests", type=int, default=48)
    ap.add_argument("--slo", default="ttft=2s,tpot=300ms")
    args = ap.parse_args()
    base = ["--dtype", args.dtype, "--device", "cpu"]
    if args.sizing:
        sizing(args, base)
        return
    cores = str(os.cpu_count() or 1)
    modes = {"plain": base, "fleet-1": [*base, "--replicas", "1", "--replica-num-cpus", cores]}
    if args.two_replicas:
        modes["fleet-2x1"] = [*base, "--replicas", "2"]
    requests = skewed(args.num_requests, 0)
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    for rnd in range(args.rounds):
        order = list(modes) if rnd % 2 == 0 else list(reversed(modes))
        for mode in order:
            rate = one_round(modes[mode], requests)
            rates[mode].append(rate)
            print(f"round {rnd + 1} {mode:10s} {rate:8.1f} output tok/s", flush=True)
    plain = statistics.mean(rates["plain"])
    for mode, values in rates.items():
        mean = statistics.mean(values)
        print(f"{mode:10s} mean {mean:8.1f} tok/s   ratio to plain {mean / plain:.3f}")


if __name__ == "__main__":
    main()
