"""Benchmark maths against hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.bench.metrics import (
    SLO,
    Distribution,
    RequestResult,
    error_counts,
    itl_from_times,
    parse_slo,
    percentile,
    summarize,
    tpot,
)


def test_percentile_hand_cases():
    assert percentile([1, 2, 3, 4], 50) == 2.5  # rank 1.5 -> halfway between 2 and 3
    assert percentile([4, 1, 3, 2], 50) == 2.5  # order does not matter
    assert percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46)  # rank 3.6 -> 40 + 0.6*10
    assert percentile([10, 20, 30, 40, 50], 99) == pytest.approx(49.6)  # rank 3.96
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([7.5], 99) == 7.5
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match="0..100"):
        percentile([1], 101)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy_linear(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-6)


def test_tpot_and_itl():
    assert tpot(e2e=1.0, ttft=0.1, output_tokens=10) == pytest.approx(0.1)  # 0.9 s over 9 tokens
    assert tpot(1.0, 0.1, 1) is None and tpot(None, 0.1, 5) is None
    assert itl_from_times([0.0, 0.1, 0.3, 0.6]) == pytest.approx([0.1, 0.2, 0.3])
    assert itl_from_times([0.5]) == []


def ok(index, ttft, e2e, out, prompt=10, itl=(), requested=None):
    return RequestResult(index=index, sent_at=0.0, ok=True, ttft=ttft, e2e=e2e, output_tokens=out,
                         prompt_tokens=prompt, itl=list(itl), requested_output_len=requested)


def failed(index, kind):
    return RequestResult(index=index, sent_at=0.0, ok=False, error_kind=kind)


def test_summary_hand_computed():
    results = [
        ok(0, ttft=0.1, e2e=1.0, out=10, itl=[0.1, 0.1], requested=10),   # tpot 0.1
        ok(1, ttft=0.3, e2e=2.3, out=5, itl=[0.5, 0.5, 1.0], requested=6),  # tpot 0.5, short
        ok(2, ttft=0.2, e2e=0.2, out=1, requested=1),                      # tpot undefined
        failed(3, "http_429"),
        failed(4, "http_429"),
        failed(5, "timeout"),
    ]
    s = summarize(results, duration_s=2.0, num_requests=8)
    assert (s.num_requests, s.sent, s.completed, s.failed, s.not_sent) == (8, 6, 3, 3, 2)
    assert s.errors == {"http_429": 2, "timeout": 1}
    assert s.total_input_tokens == 30 and s.total_output_tokens == 16
    assert s.request_throughput == 1.5
    assert s.output_throughput == 8.0 and s.total_token_throughput == 23.0
    assert s.ttft.count == 3 and s.ttft.mean == pytest.approx(0.2) and s.ttft.p50 == 0.2
    assert s.ttft.p90 == pytest.approx(0.28)  # rank 1.8 -> 0.2 + 0.8*0.1
    assert s.tpot.count == 2 and s.tpot.mean == pytest.approx(0.3) and s.tpot.p50 == pytest.approx(0.3)
    assert s.itl.count == 5 and s.itl.mean == pytest.approx(0.44) and s.itl.max == 1.0
    assert s.e2e.p50 == 1.0 and s.e2e.min == 0.2
    assert s.output_len_mismatch == 1
    assert s.slo is None and s.goodput is None and s.slo_met is None

    slo = SLO(ttft=0.25, tpot=0.2)  # met by #0 (0.1/0.1) and #2 (0.2/undefined); not #1
    g = summarize(results, duration_s=2.0, slo=slo)
    assert g.slo_met == 2 and g.goodput == 1.0
    assert g.as_dict()["slo"] == {"ttft": 0.25, "tpot": 0.2}
    assert summarize(results, 2.0, slo=SLO(e2e=0.5)).slo_met == 1
    # itl: no gap of the request over the target; #1's 1.0 s gap misses 0.6 s, #2 has no gap
    assert summarize(results, 2.0, slo=SLO(itl=0.6)).slo_met == 2
    assert summarize(results, 2.0, slo=SLO(itl=1.0)).slo_met == 3
    assert summarize(results, 2.0, slo=SLO(itl=0.05)).slo_met == 1


def test_summary_of_nothing_and_bad_duration():
    s = summarize([failed(0, "cancelled")], duration_s=1.0, slo=SLO(ttft=1))
    assert s.completed == 0 and s.ttft == Distribution(0, None, None, None, None, None, None)
    assert s.goodput == 0.0 and s.errors == {"cancelled": 1}
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], duration_s=0)
    assert error_counts([failed(0, None)]) == {"unknown": 1}


def test_parse_slo():
    assert parse_slo("ttft=500ms,tpot=100ms,e2e=2s") == SLO(ttft=0.5, tpot=0.1, e2e=2.0)
    assert parse_slo("itl=300ms") == SLO(itl=0.3) and str(SLO(ttft=1, itl=0.3)) == "ttft=1000ms,itl=300ms"
    assert parse_slo(" TTFT = 0.25s ") == SLO(ttft=0.25)
    assert parse_slo("tpot:40ms") == SLO(tpot=0.04)  # vLLM's NAME:VALUE also works
    assert str(parse_slo("ttft=500ms,e2e=2s")) == "ttft=500ms,e2e=2000ms"


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("", "empty SLO"),
        ("ttft=500", "'ttft=500': add a unit"),
        ("ttft=500ms,latency=2s", "'latency=2s': unknown metric 'latency'"),
        ("ttft=1s,ttft=2s", "'ttft=2s': ttft is given twice"),
        ("e2e=0ms", "'e2e=0ms': the target must be above zero"),
        ("ttft=fast", "'ttft=fast': expected NAME=VALUE"),
        ("ttft=5min", "'ttft=5min'"),
        ("ttft=1s,", "bad SLO part ''"),
    ],
)
def test_parse_slo_errors_name_the_bad_part(text, fragment):
    with pytest.raises(ValueError) as info:
        parse_slo(text)
    assert fragment in str(info.value)
