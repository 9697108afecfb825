"""Does watching slow serving? Engine throughput with two live dashboards open vs none.

One server (dashboard mounted at /ui), one workload (skewed, all at once, forced lengths), sent
alternately with no browser and with two headless Chromium pages on the Live tab (charts
refreshing every second), in one run. Prints output tok/s of each round and the ratio.

    .venv/bin/python benchmarks/dashboard_overhead.py [--num-requests 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import statistics

from bench_server import appliance_server

from appliance.bench.loadgen import LoadGenerator
from appliance.bench.workloads import skewed

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextlib.contextmanager
def dashboards(base_url: str, count: int):
    """`count` Chromium pages showing the Live tab (none when count is 0)."""
    if count == 0:
        yield
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            for _ in range(count):
                page = browser.new_page()
                page.goto(f"{base_url}/ui/")
                page.wait_for_selector(".main-svg", timeout=120_000)
            yield
        finally:
            browser.close()


def one_round(base_url: str, requests) -> float:
    """Send the workload from a thread of its own (Playwright's sync API holds this thread's loop)."""
    gen = LoadGenerator(requests, base_url=base_url, seed=0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        result = pool.submit(asyncio.run, gen.run()).result()
    return result.summary.output_throughput


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    requests = skewed(args.num_requests, 0)
    rates: dict[int, list[float]] = {0: [], 2: []}
    with appliance_server("--dtype", args.dtype, "--max-num-seqs", "64", dashboard=True) as (url, _db):
        one_round(url, requests[:4])  # warm-up
        for rnd in range(args.rounds):
            for count in (0, 2) if rnd % 2 == 0 else (2, 0):
                with dashboards(url, count):
                    rate = one_round(url, requests)
                rates[count].append(rate)
                print(f"round {rnd + 1}, {count} dashboards open: {rate:.1f} output tok/s", flush=True)
    none, two = statistics.mean(rates[0]), statistics.mean(rates[2])
    print(f"\nno dashboard {none:.1f} tok/s, two dashboards {two:.1f} tok/s: ratio {two / none:.3f} "
          f"({100 * (1 - two / none):+.1f} % loss)")


if __name__ == "__main__":
    main()
