"""Where one decode step's time goes, at batch 1, 16 and 64 (not a test; prints a table).

In-process: the engine (the server's defaults otherwise) brings `batch` requests of a
`--context`-token prompt into steady decode, then runs `--steps` steps. First without timers,
twice: with the layers looped over in Python (`fuse_layers` off: `the step, looped`) and as the
engine runs them (`the step, as run`: in one `decoder_layers` call where it takes them, the C
kernels with every matmul by the own GEMM; the served figures are compared with this one). Then
looped again, with timers wrapped around its parts (perf_counter, inclusive, children subtracted
from parents; the timers' own cost is in that `profiled step`):

- matmuls: every projection and the LM head (`PackedLinear`)
- attention: the KV cache writes and decode attention (`paged_attention`)
- elementwise: the norms, the rotary embedding of q and k (with their split into heads) and silu * up
- other forward: the rest of the forward (embedding, rotary tables, the layer loop's Python, the
  LM head's row pick)
- metadata: the runner's input and attention metadata (Python lists -> tensors)
- sampling, detokenise (incremental detokenizer), scheduling (`Scheduler.schedule`)
- telemetry: building the iteration record and the sinks' calls (a real SQLite TelemetryWriter
  is attached, as `appliance serve` does; its own thread's work is not in the step)
- other Python: the rest of `LLMEngine.step` (postprocess bookkeeping, stop checks, outputs)

Served: `appliance serve` with the same knobs, `batch` streaming completions of the same prompt
at once from this process; from the server's telemetry store, the engine's own step time and the
gap between steps (the engine thread outside `step`: handing outputs to the event loop, waiting
for the GIL), against the client's token rate. `HTTP/SSE + threads` = served time per step minus
the engine's in-process step (its layers in one call where it runs them so).

    python benchmarks/step_profile.py [--dtype float32] [--batches 1,16,64] [--steps 30] [--no-served]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from appliance.engine import EngineConfig, Knobs, LLMEngine, SamplingParams  # noqa: E402
from appliance.engine import detokenizer, engine as engine_module, fast_llama, model_runner, scheduler  # noqa: E402
from appliance.model_loader import load_model  # noqa: E402
from appliance.server.cli import freeze_heap  # noqa: E402

CATEGORIES = ["matmuls", "attention", "elementwise", "other forward", "metadata", "sampling", "detokenise", "scheduling",
              "telemetry", "other Python"]


class Timers:
    """Inclusive timers with children subtracted: `self.exclusive[name]` is time spent in `name`
    and not in a timed callee."""

    def __init__(self):
        self.exclusive: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open timer: [child time]

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self._stack.append([0.0])
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - t
                children = self._stack.pop()[0]
                self.exclusive[name] += took - children
                if self._stack:
                    self._stack[-1][0] += took

        return timed

    def reset(self) -> None:
        self.exclusive.clear()


def instrument(timers: Timers) -> None:
    """Wrap the engine's parts (classes and module names the engine calls through)."""
    fast_llama.PackedLinear.__call__ = timers.wrap("matmuls", fast_llama.PackedLinear.__call__)
    fast_llama.paged_attention = timers.wrap("attention", fast_llama.paged_attention)
    for part in ("_norm", "_qkv", "_act"):  # _qkv's projection is a timed matmul inside it
        setattr(fast_llama.FastLlamaForward, part, timers.wrap("elementwise", getattr(fast_llama.FastLlamaForward, part)))
    fast_llama.FastLlamaForward.__call__ = timers.wrap("other forward", fast_llama.FastLlamaForward.__call__)
    model_runner.ModelRunner.execute = timers.wrap("metadata", model_runner.ModelRunner.execute)
    engine_module.sample = timers.wrap("sampling", engine_module.sample)
    detokenizer.IncrementalDetokenizer.add = timers.wrap("detokenise", detokenizer.IncrementalDetokenizer.add)
    detokenizer.IncrementalDetokenizer.flush = timers.wrap("detokenise", detokenizer.IncrementalDetokenizer.flush)
    scheduler.Scheduler.schedule = timers.wrap("scheduling", scheduler.Scheduler.schedule)
    engine_module.LLMEngine._publish = timers.wrap("telemetry", engine_module.LLMEngine._publish)
    engine_module.LLMEngine.step = timers.wrap("other Python", engine_module.LLMEngine.step)


def knobs_for(batch: int) -> Knobs:
    return Knobs(max_num_seqs=batch, max_num_batched_tokens=max(512, batch), long_prefill_token_threshold=256)


def prompt_ids(context: int) -> list[int]:
    return [100 + (7 * j) % 5000 for j in range(context)]


def in_process(loaded, batch: int, context: int, steps: int, telemetry_url: str, fuse_layers: bool,
               timers: Timers | None = None) -> dict:
    """Steady decode steps' mean time; the parts' with `timers` (installed by `instrument`);
    `fused`: whether every timed step ran its layers in one call."""
    from appliance.telemetry import store
    from appliance.telemetry.writer import TelemetryWriter

    engine = LLMEngine(EngineConfig(dtype=str(loaded.dtype).split(".")[-1], knobs=knobs_for(batch)), loaded=loaded)
    fast, in_one_call = engine.runner.fast, [0]
    if fast is not None:
        fast.fuse_layers &= fuse_layers
        one_call = fast._layers_in_one_call

        def counted(*args):
            in_one_call[0] += 1
            return one_call(*args)

        fast._layers_in_one_call = counted
    store.upgrade(telemetry_url)
    writer = TelemetryWriter(telemetry_url, "step-profile").start()
    engine.add_sink(writer)
    try:
        params = SamplingParams(max_tokens=steps + 64, temperature=0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(str(i), prompt_ids(context), params)
        while engine.num_waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
            engine.step()
        for _ in range(3):
            engine.step()
        if timers:
            timers.reset()
        in_one_call[0] = 0
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t
    finally:
        writer.close()
    parts = {c: 1000 * timers.exclusive.get(c, 0.0) / steps for c in CATEGORIES} if timers else None
    return {"batch": batch, "step_ms": 1000 * wall / steps, "parts_ms": parts, "fused": in_one_call[0] == steps}


async def _stream_all(base_url: str, batch: int, context: int, max_tokens: int) -> list[list[float]]:
    """`batch` streaming completions at once; each one's token arrival times."""
    import httpx

    body = {"model": "any", "prompt": prompt_ids(context), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient) -> list[float]:
        times = []
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    times.append(time.time())
        return times

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=batch + 4)) as client:
        models = (await client.get(f"{base_url}/v1/models")).json()
        body["model"] = models["data"][0]["id"]
        return await asyncio.gather(*(one(client) for _ in range(batch)))


def served(dtype: str, batch: int, context: int, steps: int) -> dict:
    from bench_server import server_process

    knobs = knobs_for(batch)
    args = ["--dtype", dtype, "--max-num-seqs", str(batch), "--max-num-batched-tokens", str(knobs.max_num_batched_tokens),
            "--long-prefill-token-threshold", str(knobs.long_prefill_token_threshold)]
    with server_process(*args) as server:
        asyncio.run(_stream_all(server.base_url, min(batch, 2), 8, 4))  # warm-up
        t0 = time.time()
        arrivals = asyncio.run(_stream_all(server.base_url, batch, context, steps + 16))
        time.sleep(1.0)  # the writer flushes every 0.25 s
        db = sqlite3.connect(server.db_url.removeprefix("sqlite:///"))
        rows = db.execute("SELECT started_at, duration_s, decode_seqs, prefill_seqs FROM iterations "
                          "WHERE started_at >= ? ORDER BY started_at", (t0,)).fetchall()
        db.close()
    steady = [r for r in rows if r[2] == batch and r[3] == 0]
    steady = steady[3:-3] if len(steady) > 10 else steady  # leave out ramp up and wind down
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(steady, steady[1:])]
    # the client's view over the same window
    start, end = steady[0][0], steady[-1][0]
    tokens = sum(start <= t <= end for times in arrivals for t in times)
    return {"step_ms": 1000 * sum(r[1] for r in steady) / len(steady), "gap_ms": 1000 * sum(gaps) / max(1, len(gaps)),
            "client_tok_s": tokens / (end - start), "steps": len(steady)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-served", action="store_true", help="in-process profile only")
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    loaded = load_model(dtype=args.dtype, device="cpu")
    freeze_heap()  # as `appliance serve` does: no full collection of the model's objects in a timed step
    folder = Path(tempfile.mkdtemp(prefix="step-profile-"))
    results = []
    for batch in batches:
        looped, as_run = (in_process(loaded, batch, args.context, args.steps, f"sqlite:///{folder / f'{batch}-{way}.db'}",
                                     fuse_layers=way == "as-run") for way in ("looped", "as-run"))
        results.append({"batch": batch, "looped_ms": looped["step_ms"], "engine_step_ms": as_run["step_ms"],
                        "fused": as_run["fused"]})
    timers = Timers()
    instrument(timers)
    for r in results:
        url = f"sqlite:///{folder / (str(r['batch']) + '-profiled.db')}"
        profiled = in_process(loaded, r["batch"], args.context, args.steps, url, fuse_layers=False, timers=timers)
        r["step_ms"], r["parts_ms"] = profiled["step_ms"], profiled["parts_ms"]
    if not args.no_served:
        for r in results:
            r["served"] = served(args.dtype, r["batch"], args.context, args.steps)

    print(f"\nper decode step, {args.dtype}, context {args.context}, {torch.get_num_threads()} threads, ms (% of the step)")
    print(f"{'part':24s}" + "".join(f"{'batch ' + str(r['batch']):>18s}" for r in results))
    for c in CATEGORIES:
        print(f"{c:24s}" + "".join(f"{r['parts_ms'][c]:9.2f} ({100 * r['parts_ms'][c] / r['step_ms']:4.1f} %)" for r in results))
    print(f"{'profiled step':24s}" + "".join(f"{r['step_ms']:9.2f}{'':9s}" for r in results))
    print(f"{'the step, looped':24s}" + "".join(f"{r['looped_ms']:9.2f}{'':9s}" for r in results))
    print(f"{'the step, as run':24s}" + "".join(
        f"{r['engine_step_ms']:9.2f} {'one call' if r['fused'] else 'looped':8s}" for r in results))
    print(f"{'  tok/s as run':24s}" + "".join(f"{1000 * r['batch'] / r['engine_step_ms']:9.1f}{'':9s}" for r in results))
    if not args.no_served:
        print("served (appliance serve, streaming, all at once), against the engine's in-process step:")
        print(f"{'  engine step':24s}" + "".join(f"{r['served']['step_ms']:9.2f}{'':9s}" for r in results))
        print(f"{'  gap between steps':24s}" + "".join(f"{r['served']['gap_ms']:9.2f}{'':9s}" for r in results))
        print(f"{'  HTTP/SSE + threads':24s}" + "".join(
            f"{r['served']['step_ms'] + r['served']['gap_ms'] - r['engine_step_ms']:9.2f} "
            f"({100 * (r['served']['step_ms'] + r['served']['gap_ms'] - r['engine_step_ms']) / r['engine_step_ms']:4.1f} %)"
            for r in results))
        print(f"{'  client tok/s':24s}" + "".join(f"{r['served']['client_tok_s']:9.1f}{'':9s}" for r in results))
        print(f"{'  served / in-process':24s}" + "".join(
            f"{r['served']['client_tok_s'] * r['engine_step_ms'] / (1000 * r['batch']):9.2f}{'':9s}" for r in results))
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
