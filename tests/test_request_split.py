"""Why a request was slow: the split of its TTFT and decode time over the iterations it lived
through, on exact synthetic rows and on a real engine run written to a real SQLite store."""

from __future__ import annotations

import pytest

from appliance.engine import SamplingParams
from appliance.records import HoldCause, ITERATION_METRICS, IterationStats, RequestStats
from appliance.telemetry import request_split as rs
from appliance.telemetry import store
from appliance.telemetry.writer import TelemetryWriter


def _row(i: int, t: float, duration: float, sample: float = 0.0, prefill: int = 0, **held: int) -> IterationStats:
    base = {m.name: 0 for m in ITERATION_METRICS}
    base.update(iteration=i, started_at=t, duration_s=duration, sample_s=sample, prefill_tokens=prefill,
                policy="continuous", kv_blocks_total=100, **{HoldCause[k.upper()].column: v for k, v in held.items()})
    return IterationStats(**base)


def _store(tmp_path, name: str = "split.db") -> str:
    url = f"sqlite:///{tmp_path / name}"
    store.upgrade(url)
    return url


def test_split_of_synthetic_rows_is_exact(tmp_path):
    url = _store(tmp_path)
    writer = TelemetryWriter(url, "r1", flush_interval_s=0.05).start()
    rows = [
        _row(0, 100.0, 1.0),  # running when the request arrives (100.5): "other"
        _row(1, 101.0, 1.0, max_num_seqs=3, kv_blocks=1),  # waited through: 3/4 and 1/4
        _row(2, 102.0, 1.0, prefill=16),  # admits it at 102.01: "other"
        _row(3, 103.0, 1.0, sample=0.2, prefill=16),  # last chunk; forward ends 103.8, token at 103.85
        _row(4, 104.0, 0.5),  # decode steps: 0.5 typical
        _row(5, 104.5, 0.9, prefill=64),  # carried someone's chunk: 0.4 extra
        _row(6, 105.4, 0.5),
    ]
    for r in rows:
        writer.on_iteration(r)
    writer.on_iteration(_row(7, 200.0, 5.0, max_num_seqs=9))  # after it finished: not its life
    writer.on_request(RequestStats("slow", "api", None, 100.5, 102.01, 103.85, 105.85, 32, 4, "length", 0, 0))
    writer.on_request(RequestStats("fast", "api", None, 104.0, 104.0, 104.4, 104.5, 4, 1, "length", 0, 0))
    assert writer.flush()
    writer.close()
    slowest = rs.slowest_requests(url)
    assert [r["request_id"] for r in slowest] == ["slow", "fast"]
    assert rs.slowest_requests(url, by="ttft", limit=1)[0]["ttft_s"] == pytest.approx(3.35)
    s = rs.request_split(url, slowest[0]["id"])
    assert s.queue_s == pytest.approx(1.51)
    assert s.queue_by_cause == pytest.approx({"max_num_seqs": 0.75, "kv_blocks": 0.25, "max_num_batched_tokens": 0.0,
                                              "max_num_partial_prefills": 0.0, "max_long_partial_prefills": 0.0,
                                              "other": 0.51})
    assert s.first_token_sampling_s == pytest.approx(0.05)
    assert s.prefill_s == pytest.approx(103.85 - 102.01 - 0.05)
    assert (s.decode_s, s.decode_prefill_stall_s, s.decode_own_s) == pytest.approx((2.0, 0.4, 1.6))
    assert (s.decode_steps, s.decode_steps_with_prefill) == (3, 1)
    assert [x["phase"] for x in s.iterations] == ["queue", "queue", "prefill", "prefill", "decode", "decode", "decode"]
    with pytest.raises(LookupError):
        rs.request_split(url, 999)
    with pytest.raises(ValueError, match="by must be"):
        rs.slowest_requests(url, by="nope")


def test_split_adds_up_to_measured_ttft_and_e2e_on_a_real_run(make_engine, tmp_path):
    url = _store(tmp_path, "engine.db")
    writer = TelemetryWriter(url, "r1", flush_interval_s=0.05).start()
    # two slots: a short prompt decodes while a long one is prefilled in chunks of 16 beside it;
    # the rest wait for a slot (max_num_seqs)
    engine = make_engine(max_num_seqs=2, long_prefill_token_threshold=16, max_num_batched_tokens=64)
    engine.add_sink(writer)
    prompts = [[5] * 4, [6] * 120, [7] * 8, [8] * 8]
    engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert writer.flush()
    writer.close()
    rows = rs.slowest_requests(url, limit=10)
    assert len(rows) == 4
    splits = [rs.request_split(url, r["id"]) for r in rows]
    for s in splits:
        parts_ttft = s.queue_s + s.prefill_s + s.first_token_sampling_s
        assert parts_ttft == pytest.approx(s.ttft_s, abs=1e-9)
        assert sum(s.queue_by_cause.values()) == pytest.approx(s.queue_s, abs=1e-9)
        assert parts_ttft + s.decode_own_s + s.decode_prefill_stall_s == pytest.approx(s.e2e_s, abs=1e-9)
        for value in (s.queue_s, s.prefill_s, s.first_token_sampling_s, s.decode_own_s, s.decode_prefill_stall_s,
                      *s.queue_by_cause.values()):
            assert value >= -1e-9
        assert s.decode_steps == 11  # 12 tokens: the first from the prefill, 11 decode steps
    by_id = {s.request_id: s for s in splits}
    ids = sorted(by_id)
    short, long_, waited = by_id[ids[0]], by_id[ids[1]], by_id[ids[2]]
    # the long prompt's 8 chunks rode beside the short one's decode steps
    assert short.decode_steps_with_prefill >= 1
    # a request that waited for a slot: its queueing is counted under max_num_seqs
    assert waited.queue_by_cause["max_num_seqs"] > 0
    assert waited.queue_by_cause["max_num_seqs"] >= max(v for k, v in waited.queue_by_cause.items() if k != "other")
