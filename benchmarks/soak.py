"""Soak: requests (default 1,000) from the skewed and ShareGPT workloads against `appliance serve`
with a KV pool small enough to force preemptions (48 blocks of 16 tokens, max_model_len 192),
sent faster than the server finishes them, 20 % of them cancelled or disconnected at random
points, while the knobs are walked at random (valid sets, every 0.5 s).

Checks, printed at the end (exit 1 when one fails): every request got a complete answer with
exactly the tokens it asked for (ignore_eos + max_tokens), a clean 429, or was one the client
gave up on; the server never answered 5xx; afterwards nothing runs or waits and no KV block is
held; preemptions happened; the server's RSS grew less than 5 % from after the warm-up to the end.
Also prints telemetry rows dropped.

    .venv/bin/python benchmarks/soak.py [--requests 1000] [--rate 4] [--warmup 100] [--seed 0]

tests/test_reliability_load.py runs `churn` below as a bounded version (128 requests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from appliance.bench.workloads import sharegpt, skewed
from bench_server import server_process

MODEL_LEN = 192
SERVE_ARGS = ("--num-blocks", "48", "--block-size", "16", "--max-model-len", str(MODEL_LEN),
              "--max-waiting", "64")
CHAT_OVERHEAD = 32  # tokens the chat template adds around one user message (30 for SmolLM2)
MAX_OUTPUT = 16


# -- the workload -------------------------------------------------------------------------------
@dataclass
class ChurnRequest:
    """One request: where it goes, its body, and when the client gives up on it (if ever)."""

    index: int
    path: str  # /v1/completions (skewed, token ids) or /v1/chat/completions (ShareGPT text)
    body: dict[str, Any]
    cancel_after_s: float | None = None  # close the connection after this long
    cancel_after_chunks: int | None = None  # (streams) close after this many events

    @property
    def asked(self) -> int:
        return self.body["max_tokens"]

    @property
    def cancels(self) -> bool:
        return self.cancel_after_s is not None or self.cancel_after_chunks is not None


def build_requests(n: int, seed: int, tokenizer: Any, model_len: int = MODEL_LEN,
                   cancel_fraction: float = 0.2) -> list[ChurnRequest]:
    """Half skewed (token-id completions), half ShareGPT (chat), shuffled; output lengths 1-16
    forced with ignore_eos; prompts cut to fit `model_len`; a random `cancel_fraction` of them
    is given up on after a random time (0-3 s) or number of stream events."""
    rng = random.Random(seed)
    n_skewed = n // 2
    room = model_len - MAX_OUTPUT
    prompts: list[tuple[str, Any]] = [("ids", r.prompt_ids[:room]) for r in skewed(n_skewed, seed)]
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    prompts += [("chat", r.prompt) for r in sharegpt(n - n_skewed, seed, count, max_prompt_len=room - CHAT_OVERHEAD,
                                                       max_total_len=10**9)]
    rng.shuffle(prompts)
    cancelled = set(rng.sample(range(n), round(n * cancel_fraction)))
    out = []
    for i, (kind, prompt) in enumerate(prompts):
        stream = rng.random() < 0.5
        body: dict[str, Any] = {"max_tokens": rng.randint(1, MAX_OUTPUT), "ignore_eos": True,
                                "temperature": rng.choice([0.0, 0.7, 1.0]), "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if kind == "ids":
            path, body["prompt"] = "/v1/completions", prompt
        else:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        req = ChurnRequest(i, path, body)
        if i in cancelled:
            if stream and rng.random() < 0.5:
                req.cancel_after_chunks = rng.randint(0, body["max_tokens"])
            else:
                req.cancel_after_s = rng.uniform(0.0, 3.0)
        out.append(req)
    return out


def random_knobs(rng: random.Random) -> dict[str, Any]:
    """A random valid knob set (small enough to matter for a 48-block pool)."""
    seqs = rng.randint(1, 16)
    budget = rng.randint(max(seqs, 32), 512)
    partial = rng.randint(1, 4)
    return {"max_num_seqs": seqs, "max_num_batched_tokens": budget,
            "long_prefill_token_threshold": rng.randint(8, budget), "max_num_partial_prefills": partial,
            "max_long_partial_prefills": rng.randint(1, partial),
            "scheduling_policy": "static" if rng.random() < 0.2 else "continuous"}


# -- driving it -----------------------------------------------------------------------------------
@dataclass
class Outcome:
    index: int
    asked: int
    gave_up: bool = False  # the client cancelled / disconnected before the reply ended
    status: int | None = None
    tokens: int | None = None  # usage.completion_tokens
    finish_reason: str | None = None
    done: bool = False  # the stream ended with data: [DONE] (non-streams: a whole JSON body)
    error_body: dict | None = None
    exception: str | None = None


@dataclass
class ChurnReport:
    outcomes: list[Outcome]
    knob_statuses: list[int]
    max_waiting: int = 0
    max_blocks_used: int = 0
    elapsed_s: float = 0.0
    sent_over_s: float = 0.0

    def count(self, **match: Any) -> int:
        return sum(all(getattr(o, k) == v for k, v in match.items()) for o in self.outcomes)

    def problems(self) -> list[str]:
        """Every request that did not end in a complete answer, a clean 429, or a client give-up."""
        found = []
        for o in self.outcomes:
            if o.status is not None and o.status >= 500:
                found.append(f"request {o.index}: HTTP {o.status} {o.error_body}")
            elif o.exception is not None:
                found.append(f"request {o.index}: {o.exception}")
            elif o.status == 429:
                if not _openai_error(o.error_body):
                    found.append(f"request {o.index}: 429 without an OpenAI error body: {o.error_body}")
            elif o.status == 200 and (o.done or not o.gave_up):
                if (o.finish_reason, o.tokens, o.done) != ("length", o.asked, True):
                    found.append(f"request {o.index}: asked {o.asked} tokens, got {o.tokens} "
                                 f"(finish_reason {o.finish_reason}, complete {o.done})")
            elif o.status not in (None, 200):
                found.append(f"request {o.index}: HTTP {o.status} {o.error_body}")
            elif not o.gave_up:
                found.append(f"request {o.index}: no answer")
        bad_knobs = [s for s in self.knob_statuses if s != 200]
        if bad_knobs:
            found.append(f"knob changes answered {bad_knobs}")
        return found


def _openai_error(body: Any) -> bool:
    return (isinstance(body, dict) and isinstance(body.get("error"), dict)
            and set(body["error"]) == {"message", "type", "param", "code"})


async def _one(client: httpx.AsyncClient, req: ChurnRequest) -> Outcome:
    out = Outcome(req.index, req.asked)
    try:
        if req.cancel_after_s is not None:
            try:
                await asyncio.wait_for(_exchange(client, req, out), req.cancel_after_s)
            except asyncio.TimeoutError:
                out.gave_up = True
        else:
            await _exchange(client, req, out)
    except httpx.HTTPError as exc:
        out.exception = f"{type(exc).__name__}: {exc}"
    return out


async def _exchange(client: httpx.AsyncClient, req: ChurnRequest, out: Outcome) -> None:
    if not req.body["stream"]:
        response = await client.post(req.path, json=req.body)
        out.status = response.status_code
        body = response.json()
        if response.status_code == 200:
            out.tokens, out.done = body["usage"]["completion_tokens"], True
            out.finish_reason = body["choices"][0]["finish_reason"]
        else:
            out.error_body = body
        return
    async with client.stream("POST", req.path, json=req.body) as response:
        out.status = response.status_code
        if response.status_code != 200:
            out.error_body = json.loads(await response.aread())
            return
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.error_body = chunk
            for choice in chunk.get("choices") or []:
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            if chunk.get("usage"):
                out.tokens = chunk["usage"]["completion_tokens"]
            events += 1
            if req.cancel_after_chunks is not None and events > req.cancel_after_chunks:
                out.gave_up = True  # leaving the block closes the connection mid-stream
                return


async def churn(base_url: str, requests: list[ChurnRequest], rate: float, seed: int = 0,
                knob_interval_s: float = 0.5, headers: dict[str, str] | None = None) -> ChurnReport:
    """Send `requests` as Poisson arrivals at `rate`/s while walking the knobs; afterwards put
    the knobs back as they were. Returns every request's outcome."""
    rng = random.Random(seed + 1)
    stop = asyncio.Event()
    report = ChurnReport([], [])
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits, headers=headers) as client:
        original = (await client.get("/admin/knobs")).json()["knobs"]

        async def walk_knobs() -> None:
            while not stop.is_set():
                await asyncio.sleep(knob_interval_s)
                report.knob_statuses.append((await client.patch("/admin/knobs", json=random_knobs(rng))).status_code)

        async def watch_state() -> None:
            while not stop.is_set():
                state = (await client.get("/admin/state")).json()
                report.max_waiting = max(report.max_waiting, state["waiting"])
                report.max_blocks_used = max(report.max_blocks_used, state["kv_blocks_used"])
                await asyncio.sleep(0.2)

        side = [asyncio.create_task(walk_knobs()), asyncio.create_task(watch_state())]
        t0 = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(_one(client, req)))
            await asyncio.sleep(rng.expovariate(rate))
        report.sent_over_s = time.perf_counter() - t0
        report.outcomes = list(await asyncio.gather(*tasks))
        report.elapsed_s = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*side)
        restore = await client.patch("/admin/knobs", json={"max_num_batched_tokens": 4096})
        report.knob_statuses += [restore.status_code, (await client.patch("/admin/knobs", json=original)).status_code]
    return report


async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 60.0) -> dict[str, Any]:
    """/admin/state once nothing runs or waits and no KV block is held (AssertionError if never)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = (await client.get("/admin/state")).json()
        if (state["running"], state["waiting"], state["kv_blocks_used"], state["in_flight"]) == (0, 0, 0, 0):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine is not idle {timeout_s:g}s after the load: {state}")
        await asyncio.sleep(0.1)


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


# -- the soak -------------------------------------------------------------------------------------
def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def soak(args: argparse.Namespace, base_url: str, pid: int) -> int:
    from appliance.model_loader import load_tokenizer

    requests = build_requests(args.requests + args.warmup, args.seed, load_tokenizer(None))
    warmup, main_part = requests[:args.warmup], requests[args.warmup:]
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        before = (await client.get("/metrics")).text
        rss_start = rss_mib(pid)
        if warmup:
            await churn(base_url, warmup, args.rate, args.seed)
            await wait_idle(client)
        rss_warm = rss_mib(pid)
        print(f"RSS at start {rss_start:.1f} MiB, after {len(warmup)} warm-up requests {rss_warm:.1f} MiB", flush=True)
        report = await churn(base_url, main_part, args.rate, args.seed + 7)
        state = await wait_idle(client)
        rss_end = rss_mib(pid)
        after = (await client.get("/metrics")).text
    growth = (rss_end - rss_warm) / rss_warm * 100
    preemptions = metric(after, "appliance:num_preemptions_total") - metric(before, "appliance:num_preemptions_total")
    finished = {r: metric(after, "appliance:request_success_total", finished_reason=r)
                - metric(before, "appliance:request_success_total", finished_reason=r)
                for r in ("length", "stop", "abort", "error")}
    problems = report.problems()
    n = len(report.outcomes)
    print(f"{n} requests in {report.elapsed_s:.1f}s (sent over {report.sent_over_s:.1f}s, rate {args.rate:g}/s): "
          f"{report.count(status=200, done=True)} complete, {report.count(status=429)} got 429, "
          f"{report.count(gave_up=True)} given up by the client; "
          f"peak waiting {report.max_waiting}, peak KV blocks {report.max_blocks_used}/{state['kv_blocks_total']}")
    print(f"knob changes: {len(report.knob_statuses)} (statuses {sorted(set(report.knob_statuses))}); "
          f"engine finishes (warm-up included): {finished}; preemptions {preemptions:.0f}")
    print(f"after: running {state['running']}, waiting {state['waiting']}, kv_blocks_used {state['kv_blocks_used']}")
    print(f"RSS end {rss_end:.1f} MiB: growth after warm-up {growth:+.2f} % (limit 5 %)")
    print(f"telemetry rows dropped: {state['telemetry_rows_dropped']:.0f}")
    if preemptions == 0:
        problems.append("no preemption happened")
    if finished["error"]:
        problems.append(f"{finished['error']:.0f} requests ended with an engine error")
    if growth >= 5:
        problems.append(f"RSS grew {growth:.1f} % after the warm-up")
    for problem in problems[:30]:
        print("PROBLEM:", problem)
    print("OK" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests after the warm-up")
    parser.add_argument("--warmup", type=int, default=100, help="requests before the RSS baseline")
    parser.add_argument("--rate", type=float, default=4.0,
                        help="Poisson arrivals per second (above what the server finishes: ~2-3/s on 2 CPU cores)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with server_process("--dtype", "float32", "--device", "cpu", *SERVE_ARGS) as server:
        print(f"server pid {server.pid} {' '.join(SERVE_ARGS)}", flush=True)
        started = time.monotonic()
        code = asyncio.run(soak(args, server.base_url, server.pid))
        print(f"soak took {time.monotonic() - started:.0f}s")
        return code

if __name__ == "__main__":
    sys.exit(main())
