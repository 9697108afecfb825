"""The replay against the real engine: driven by the recorded step times and arrival times, the
engine's Scheduler on a virtual clock reproduces every iteration the real engine ran."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from appliance.engine import SamplingParams
from appliance.sim.replay import CacheShape, RecordedSteps, SimRequest, replay

COMPOSITION = ("prefill_seqs", "prefill_tokens", "decode_seqs", "decode_tokens", "decode_context_tokens",
               "padding_tokens", "running", "waiting", "kv_blocks_used", "preemptions", "finished")


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_recorded_run_replays_to_the_same_iterations(make_engine, record_iterations, policy):
    knobs = dict(max_num_seqs=4, max_num_batched_tokens=48, long_prefill_token_threshold=24,
                 max_num_partial_prefills=2, scheduling_policy=policy)
    # 10 blocks of 16 = 160 tokens for up to 4 sequences of up to 90 tokens: preemptions happen
    engine = make_engine(num_blocks=10, max_model_len=160, **knobs)
    stats = record_iterations(engine)
    rng = random.Random(9)
    lengths = [(rng.randint(3, 60), rng.randint(1, 30)) for _ in range(10)]
    add_before = sorted(rng.randint(0, 25) for _ in lengths)  # iteration before which each arrives
    arrivals: list[float] = []
    i = 0
    while i < len(lengths) or engine.has_unfinished():
        while i < len(lengths) and (add_before[i] <= engine.iteration or not engine.has_unfinished()):
            arrivals.append(time.time())
            prompt, output = lengths[i]
            start = 100 + 100 * i  # prompts share no prefix: the replay does not model cache hits
            engine.add_request(f"r{i}", list(range(start, start + prompt)),
                               SamplingParams(max_tokens=output, ignore_eos=True, temperature=0.0),
                               arrival=arrivals[-1])
            i += 1
        engine.step()

    t0 = stats[0].started_at
    requests = [SimRequest(a - t0, p, o) for a, (p, o) in zip(arrivals, lengths)]
    steps = [dataclasses.replace(s, started_at=s.started_at - t0) for s in stats]
    out = replay(requests, engine.knobs, CacheShape(10, 16, 160), RecordedSteps(steps))

    assert len(out.iterations) == len(stats)
    for real, sim in zip(stats, out.iterations):
        assert {k: getattr(sim, k) for k in COMPOSITION} == {k: getattr(real, k) for k in COMPOSITION}, real.iteration
    assert [r.output_tokens for r in out.results] == [o for _, o in lengths]
    assert 30 < len(stats) < 200  # the case stays small
    if policy == "continuous":
        assert sum(s.preemptions for s in stats) > 0  # the case covers preemption and recompute


def test_a_run_with_prefix_cache_hits_replays_to_the_same_iterations(make_engine, record_iterations):
    """Half the prompts repeat (all or a part of) an earlier, finished prompt: the engine serves
    those blocks from its cache, and the replay, given each request's recorded cached tokens,
    computes the same tokens in the same iterations."""
    knobs = dict(max_num_seqs=4, max_num_batched_tokens=48, long_prefill_token_threshold=24)
    engine = make_engine(num_blocks=64, max_model_len=256, **knobs)
    stats = record_iterations(engine)
    rng = random.Random(4)
    firsts = [list(range(100 * (i + 1), 100 * (i + 1) + rng.randint(20, 70))) for i in range(4)]
    # repeats: a whole earlier prompt, or its first 40 tokens and a new tail
    seconds = [firsts[0], firsts[1][:40] + list(range(900, 911)), firsts[2], firsts[3][:18] + [7] * 30]
    outputs = [rng.randint(2, 12) for _ in range(8)]
    arrivals: list[float] = []
    cached: dict[str, int] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                cached[out.request_id] = out.cached_tokens

    for phase, prompts in enumerate((firsts, seconds)):  # the repeats come after the firsts finished
        for j, prompt in enumerate(prompts):
            i = 4 * phase + j
            arrivals.append(time.time())
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=outputs[i], ignore_eos=True, temperature=0.0),
                               arrival=arrivals[-1])
            step()  # staggered: one iteration between arrivals
        while engine.has_unfinished():
            step()

    prompts = firsts + seconds
    assert [cached[f"r{i}"] for i in range(4)] == [0, 0, 0, 0]
    assert all(cached[f"r{i}"] > 0 for i in range(4, 8))  # the case exercises the cache
    t0 = stats[0].started_at
    requests = [SimRequest(a - t0, len(p), o, cached_tokens=cached[f"r{i}"])
                for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]
    steps = [dataclasses.replace(s, started_at=s.started_at - t0) for s in stats]
    out = replay(requests, engine.knobs, CacheShape(64, 16, 256), RecordedSteps(steps))
    assert len(out.iterations) == len(stats)
    for real, sim in zip(stats, out.iterations):
        keys = (*COMPOSITION, "prefix_cache_queries", "prefix_cache_hits")
        assert {k: getattr(sim, k) for k in keys} == {k: getattr(real, k) for k in keys}, real.iteration
