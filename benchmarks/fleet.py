"""What does Ray Serve cost? Skewed-64 against the plain single process and against a fleet of
one replica on Ray Serve (`--replicas 1`, the replica reserving every core), in alternating
rounds in one run; prints output tok/s of each round, the means and fleet/plain (target >= 0.9:
the router's and the ingress's cost). With --two-replicas, also a fleet of two replicas with one
torch thread each (`--replicas 2`) against the same plain process.

Each server is started fresh for its round and stopped after it (only one runs at a time: they
would share the cores). This box is shared; run it at least twice.

    .venv/bin/python benchmarks/fleet.py [--num-requests 64] [--rounds 2] [--two-replicas]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

from bench_server import server_process

from appliance.bench.loadgen import LoadGenerator
from appliance.bench.workloads import skewed


def one_round(serve_args: list[str], requests) -> float:
    with server_process(*serve_args, ready_timeout_s=600.0) as server:
        result = asyncio.run(LoadGenerator(requests, base_url=server.base_url, seed=0).run())
    return result.summary.output_throughput


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--two-replicas", action="store_true")
    args = ap.parse_args()
    base = ["--dtype", args.dtype, "--device", "cpu"]
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
