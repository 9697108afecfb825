"""Ranking a tuning grid in simulation (appliance.sim.rank): hand-built step-time model and
workload, no model weights."""

from __future__ import annotations

import random
from types import SimpleNamespace

from appliance.bench.metrics import SLO
from appliance.engine.knobs import Knobs
from appliance.sim.fit import INTERCEPT, EngineKey, StepTimeModel
from appliance.sim.rank import SLOWER, RankedPoint, rank_grid
from appliance.sim.replay import CacheShape, SimRequest

# a step: 10 ms + 2 ms per decode row + 1 ms per prefill token
MODEL = StepTimeModel(EngineKey("m", "float32", "cpu"),
                      {INTERCEPT: 0.01, "decode_rows": 0.002, "prefill_tokens": 0.001, "prefill_seqs": 0.0,
                       "decode_context_tokens": 0.0}, 0.0005, "test", 0, 0, 0.0, 0.0)
RUN = SimpleNamespace(knobs=Knobs(max_num_seqs=16, max_num_batched_tokens=256, long_prefill_token_threshold=64),
                      cache=CacheShape(1024, 16, 1024))


def poisson(rate: float, seconds: float, seed: int = 3) -> list[SimRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    while (t := t + rng.expovariate(rate)) < seconds:
        out.append(SimRequest(t, 10, 40))
    return out


def test_a_point_that_keeps_the_slo_only_at_the_models_own_times_ranks_below_one_with_headroom():
    # 4 requests/s of 40 tokens each: 4 sequences at once serve ~5.3/s at the model's times (a
    # short queue) and ~4.4/s at 1.2x them (close to the arrival rate: the queue grows); 16 at
    # once serve either with room to spare
    ranked, invalid = rank_grid(RUN, MODEL, [{"max_num_seqs": 4}, {"max_num_seqs": 16}], poisson(4.0, 60.0),
                                SLO(ttft=1.0), attainment=0.9)
    assert not invalid
    by_seqs = {p.knobs["max_num_seqs"]: p for p in ranked}
    assert by_seqs[4].predicted["meets_slo"] and not by_seqs[4].slower["meets_slo"]
    assert by_seqs[4].slower["ttft_p99"] > 2 * by_seqs[4].predicted["ttft_p99"]
    assert by_seqs[16].predicted["meets_slo"] and by_seqs[16].slower["meets_slo"]
    assert [p.knobs["max_num_seqs"] for p in ranked] == [16, 4]


def test_where_no_point_keeps_the_slo_the_mean_of_both_replays_ranks_not_the_slower_alone():
    # run 110 of benchmarks/autopilot.py, as predicted within the SLO (share of 1473 requests over
    # 180 s) at the model's times and at 1.2x: past capacity at 1.2x the whole grid fell to 0-6 %;
    # the first two points measured 10.5 and 12.1 % live, the defaults 48 %
    def point(chunk: int, budget: int, at_model: float, at_slower: float) -> RankedPoint:
        def figures(share: float) -> dict[str, float | None]:
            return {"meets_slo": float(share >= 0.9), "attainment": share, "goodput": share * 1473 / 180,
                    "output_throughput": 240.0}
        return RankedPoint({"long_prefill_token_threshold": chunk, "max_num_batched_tokens": budget},
                           figures(at_model), figures(at_slower))

    grid = [point(64, 256, 0.33, 0.06), point(256, 512, 0.41, 0.01), point(256, 256, 0.50, 0.02)]
    assert max(grid, key=lambda p: p.slower["goodput"]).knobs["long_prefill_token_threshold"] == 64
    ranked = sorted(grid, key=lambda p: p.key, reverse=True)
    assert [(p.knobs["long_prefill_token_threshold"], p.knobs["max_num_batched_tokens"]) for p in ranked] == [
        (256, 256), (256, 512), (64, 256)]
    # meeting the SLO still comes first: at the slower times, then at the model's, whatever the
    # mean (steady's 87 % over both beats fragile's 84.5 % and misses the SLO at both)
    held, fragile, steady = point(64, 256, 0.96, 0.95), point(256, 256, 0.99, 0.70), point(128, 256, 0.89, 0.85)
    ranked = sorted([steady, fragile, held, *grid], key=lambda p: p.key, reverse=True)
    assert ranked[:3] == [held, fragile, steady]


def test_the_slower_replay_is_the_same_replay_with_every_step_longer():
    requests = poisson(2.0, 20.0)
    same, _ = rank_grid(RUN, MODEL, [{"max_num_seqs": 8}], requests, SLO(ttft=1.0), 0.9, slower=1.0)
    assert same[0].slower == same[0].predicted
    slow, _ = rank_grid(RUN, MODEL, [{"max_num_seqs": 8}], requests, SLO(ttft=1.0), 0.9)
    assert slow[0].predicted == same[0].predicted
    assert slow[0].slower["itl_p99"] > slow[0].predicted["itl_p99"] * (1 + (SLOWER - 1) / 2)
