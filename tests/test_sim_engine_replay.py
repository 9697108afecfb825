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
