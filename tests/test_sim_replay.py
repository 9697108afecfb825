"""The replay (appliance.sim.replay): the engine's scheduler on a virtual clock, no model."""

from __future__ import annotations

import dataclasses
import random

import pytest

from appliance.bench.metrics import SLO
from appliance.engine.knobs import Knobs
from appliance.sim.fit import INTERCEPT, EngineKey, StepTimeModel, composition_of
from appliance.sim.replay import CacheShape, ReplayError, SimRequest, replay

KEY = EngineKey("m", "float32", "cpu")


def model(intercept=0.01, decode=0.002, prefill=0.001, chunks=0.0, context=0.0001, gap=0.0005) -> StepTimeModel:
    coefficients = {INTERCEPT: intercept, "decode_rows": decode, "prefill_tokens": prefill, "prefill_seqs": chunks,
                    "decode_context_tokens": context}
    return StepTimeModel(KEY, coefficients, gap, "test", 0, 0, 0.0, 0.0)


def test_one_request_follows_the_hand_computed_timeline():
    # 40-token prompt in chunks of 16, then 3 output tokens. Step = 0.01 + 0.001/prefill token
    # + 0.002/decode row + 0.0001/attended token; 0.5 ms between steps; arrival at t=1.
    knobs = Knobs(max_num_seqs=4, max_num_batched_tokens=32, long_prefill_token_threshold=16)
    out = replay([SimRequest(1.0, 40, 3)], knobs, CacheShape(16, 16, 256), model())
    starts = [1.0, 1.0265, 1.053, 1.0715, 1.0881]
    durations = [0.026, 0.026, 0.018, 0.01 + 0.002 + 0.0041, 0.01 + 0.002 + 0.0042]
    assert [it.started_at for it in out.iterations] == pytest.approx(starts)
    assert [it.duration_s for it in out.iterations] == pytest.approx(durations)
    assert [(it.prefill_tokens, it.decode_tokens) for it in out.iterations] == [(16, 0), (16, 0), (8, 0), (0, 1), (0, 1)]
    assert [it.decode_context_tokens for it in out.iterations] == [0, 0, 0, 41, 42]
    assert [it.kv_blocks_used for it in out.iterations] == [1, 2, 3, 3, 0]  # freed when it finishes
    assert [it.finished for it in out.iterations] == [0, 0, 0, 0, 1]
    (r,) = out.results
    token_times = [1.071, 1.0876, 1.1043]
    assert r.ok and r.output_tokens == 3 and r.prompt_tokens == 40
    assert r.ttft == pytest.approx(token_times[0] - 1.0)
    assert r.itl == pytest.approx([token_times[1] - token_times[0], token_times[2] - token_times[1]])
    assert r.e2e == pytest.approx(token_times[2] - 1.0)
    assert out.duration_s == pytest.approx(token_times[2])
    s = out.summary
    assert s.completed == 1 and s.total_output_tokens == 3
    assert s.output_throughput == pytest.approx(3 / token_times[2])
    assert s.tpot.p50 == pytest.approx((token_times[2] - token_times[0]) / 2)


def random_requests(n: int, rate: float, seed: int) -> list[SimRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(SimRequest(t, rng.randint(5, 300), rng.randint(1, 120)))
    return out


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_a_small_cache_preempts_yet_every_request_gets_all_its_tokens(policy):
    requests = random_requests(60, rate=50.0, seed=3)
    knobs = Knobs(max_num_seqs=16, max_num_batched_tokens=256, long_prefill_token_threshold=64,
                  max_num_partial_prefills=2, scheduling_policy=policy)
    out = replay(requests, knobs, CacheShape(40, 16, 640), model())
    assert [r.output_tokens for r in out.results] == [q.output_tokens for q in requests]
    assert all(r.ok and r.ttft > 0 and r.e2e >= r.ttft for r in out.results)
    assert all(it.kv_blocks_used <= 40 and it.running <= 16 for it in out.iterations)
    assert all(it.scheduled_tokens <= 256 for it in out.iterations)
    prefilled = sum(it.prefill_tokens for it in out.iterations)
    assert prefilled >= sum(q.prompt_tokens for q in requests)  # recomputed after preemption: more
    if policy == "continuous":
        assert sum(it.preemptions for it in out.iterations) > 0  # the cache really was too small


def test_closed_loop_concurrency_one_runs_requests_back_to_back():
    requests = [SimRequest(99.0, 10 + i, 5) for i in range(4)]  # arrivals ignored in closed loop
    out = replay(requests, Knobs(), CacheShape(64, 16, 1024), model(), concurrency=1)
    ends = [r.sent_at + r.e2e for r in out.results]
    assert out.results[0].sent_at == 0.0
    assert [r.sent_at for r in out.results[1:]] == pytest.approx(ends[:-1])
    assert all(it.running <= 1 for it in out.iterations)


def test_a_cancelled_request_frees_its_blocks_and_counts_as_failed():
    requests = [SimRequest(0.0, 20, 1000, cancel_at=0.2), SimRequest(0.0, 20, 5)]
    out = replay(requests, Knobs(), CacheShape(128, 16, 2048), model(), slo=SLO(ttft=1.0))
    cancelled, done = out.results
    assert not cancelled.ok and cancelled.error_kind == "cancelled" and 0 < cancelled.output_tokens < 1000
    assert done.ok and done.output_tokens == 5
    assert all(it.started_at < 0.2 for it in out.iterations)  # nothing left to run after the cancel
    assert out.summary.completed == 1 and out.summary.failed == 1 and out.summary.slo_met == 1


def test_replay_is_deterministic_and_fast_enough_to_sweep():
    requests = random_requests(200, rate=4.0, seed=0)
    a = replay(requests, Knobs(), CacheShape(2000, 16, 8192), model())
    b = replay(requests, Knobs(), CacheShape(2000, 16, 8192), model())
    assert a.summary == b.summary and len(a.iterations) == len(b.iterations)


@pytest.mark.parametrize("request_, cache, message", [
    (SimRequest(0, 900, 200), CacheShape(512, 16, 1024), r"request 1: 900 prompt \+ 200 output tokens = 1100 exceeds max_model_len 1024"),
    (SimRequest(0, 300, 100), CacheShape(20, 16, 1024), r"request 1: 400 tokens do not fit in the KV cache \(num_blocks 20 x block_size 16 = 320"),
    (SimRequest(0, 0, 100), CacheShape(20, 16, 1024), r"request 1: prompt_tokens 0"),
])
def test_a_request_the_engine_cannot_hold_is_an_error_naming_it(request_, cache, message):
    with pytest.raises(ReplayError, match=message):
        replay([SimRequest(0, 10, 10), request_], Knobs(), cache, model())


def test_step_time_spread_is_drawn_per_iteration_the_same_way_for_the_same_seed():
    requests = random_requests(40, rate=20.0, seed=5)
    plain = replay(requests, Knobs(), CacheShape(512, 16, 1024), model())
    doubled = model()
    doubled.noise = (2.0,) * 101
    twice = replay(requests, Knobs(), CacheShape(512, 16, 1024), doubled)
    assert sum(it.duration_s for it in twice.iterations) > 1.5 * sum(it.duration_s for it in plain.iterations)
    spread = model()
    spread.noise = tuple(0.5 + i / 100 for i in range(101))  # ratios 0.5 .. 1.5
    a, b = (replay(requests, Knobs(), CacheShape(512, 16, 1024), spread, seed=7) for _ in range(2))
    assert [it.duration_s for it in a.iterations] == [it.duration_s for it in b.iterations]
    c = replay(requests, Knobs(), CacheShape(512, 16, 1024), spread, seed=8)
    assert [it.duration_s for it in c.iterations] != [it.duration_s for it in a.iterations]
    for it in a.iterations:  # each lasts its composition's prediction times a ratio within the spread
        ratio = it.duration_s / spread.predict(composition_of(dataclasses.asdict(it)))
        assert 0.5 - 1e-9 <= ratio <= 1.5 + 1e-9
    assert a.summary.completed == c.summary.completed == len(requests)


def test_recorded_cache_hits_are_replayed_only_with_prefix_caching_on():
    # 100-token prompt of which 64 were served from the cache: 36 computed (2 chunks of 32 -> 1)
    request = [SimRequest(0.0, 100, 2, cached_tokens=64)]
    knobs = Knobs(max_num_seqs=4, max_num_batched_tokens=32, long_prefill_token_threshold=32)
    on = replay(request, knobs, CacheShape(64, 16, 1024), model())
    assert [it.prefill_tokens for it in on.iterations if it.prefill_seqs] == [32, 4]
    assert sum(it.prefix_cache_hits for it in on.iterations) == 64
    off = replay(request, Knobs(max_num_seqs=4, max_num_batched_tokens=32, long_prefill_token_threshold=32,
                                enable_prefix_caching=False), CacheShape(64, 16, 1024), model())
    assert [it.prefill_tokens for it in off.iterations if it.prefill_seqs] == [32, 32, 32, 4]
    # a hit is whole blocks and never the last prompt token: 20 cached of a 20-token prompt -> 16
    short = replay([SimRequest(0.0, 20, 1, cached_tokens=20)], knobs, CacheShape(64, 16, 1024), model())
    assert [it.prefill_tokens for it in short.iterations] == [4]
    # no room to hold the prefix when it arrives (the cache is full with a running request): a miss
    tight = replay([SimRequest(0.0, 100, 28), SimRequest(0.01, 40, 1, cached_tokens=32)],
                   Knobs(), CacheShape(8, 16, 128), model())
    assert tight.summary.completed == 2 and sum(it.prefix_cache_hits for it in tight.iterations) == 0
