"""Two small stored runs on a real server for the report tests: run A with max_num_seqs=2 and a
live knob change in the middle, run B with max_num_seqs=8."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import httpx

from appliance.bench.loadgen import LoadGenerator
from appliance.bench.runner import BenchmarkRun, run_benchmark
from appliance.bench.workloads import skewed


@dataclass
class StoredRuns:
    db: str
    base_url: str
    a: BenchmarkRun
    b: BenchmarkRun


def requests(n: int = 6):
    """`n` skewed requests cut to short prompts (<= 48 tokens) and outputs (<= 8 tokens)."""
    return [dataclasses.replace(r, prompt=None, prompt_ids=r.prompt_ids[:48], prompt_len=min(r.prompt_len, 48),
                                output_len=min(r.output_len, 8)) for r in skewed(n, seed=5)]


async def _run(base_url: str, db: str, name: str, change: dict | None) -> BenchmarkRun:
    first_done = asyncio.Event()  # the change lands mid-run: after the first of six requests ended

    def progress(p) -> None:
        if p.done >= 1:
            first_done.set()

    generator = LoadGenerator(requests(), base_url=base_url, progress=progress)
    task = asyncio.ensure_future(run_benchmark(generator, workload="skewed n=6", name=name, db_url=db))
    if change:
        await asyncio.wait_for(first_done.wait(), timeout=300)
        async with httpx.AsyncClient(base_url=base_url) as client:
            assert (await client.patch("/admin/knobs", json=change)).status_code == 200
    return await task


def make_runs(srv, db: str) -> StoredRuns:
    url = srv.base_url
    httpx.patch(f"{url}/admin/knobs", json={"max_num_seqs": 2}).raise_for_status()
    a = asyncio.run(_run(url, db, "seqs-2", {"max_num_seqs": 3}))
    httpx.patch(f"{url}/admin/knobs", json={"max_num_seqs": 8}).raise_for_status()
    b = asyncio.run(_run(url, db, "seqs-8", None))
    assert srv.writer.flush(10)
    return StoredRuns(db, url, a, b)
