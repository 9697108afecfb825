"""The "what is holding traffic back" reading on synthetic windows, and the held-time query on a
real SQLite store written through the real writer."""

from __future__ import annotations

import pytest

from appliance.records import HoldCause, IterationStats, ITERATION_METRICS
from appliance.telemetry import queries, store
from appliance.telemetry.writer import TelemetryWriter
from ui import holding

KNOBS = {"max_num_seqs": 24, "max_num_batched_tokens": 512, "max_num_partial_prefills": 1,
         "max_long_partial_prefills": 1, "long_prefill_token_threshold": 256}
C = HoldCause


def totals(**seconds: float) -> dict[HoldCause, float]:
    out = dict.fromkeys(HoldCause, 0.0)
    out.update({HoldCause[k.upper()]: v for k, v in seconds.items()})
    return out


def test_nothing_waited():
    assert holding.reading(totals(), "the last 5 min", KNOBS, 0.9) == (
        "No request waited in the last 5 min: no limit held traffic back.")
    assert holding.shares(totals()) == {}


def test_max_num_seqs_with_room_in_the_cache():
    text = holding.reading(totals(max_num_seqs=78.0, token_budget=22.0), "the last 5 min", KNOBS, 0.37)
    assert text == ("78 % of the 100.0 request-s of queueing in the last 5 min was max_num_seqs (24) "
                    "while KV usage stayed under 40 %: raising max_num_seqs should help.")


def test_max_num_seqs_with_a_full_cache_does_not_promise_help():
    text = holding.reading(totals(max_num_seqs=9.0, kv_blocks=1.0), "run r", KNOBS, 0.93)
    assert "90 %" in text and "KV usage reached 93 %" in text and "should help" not in text
    assert "preemptions" in text


@pytest.mark.parametrize("peak, bound", [(0.0, 10), (0.399, 40), (0.40, 50), (0.79, 80)])
def test_the_kv_bound_is_never_below_the_peak(peak, bound):
    text = holding.reading(totals(max_num_seqs=1.0), "w", KNOBS, peak)
    assert f"under {bound} %" in text and bound > peak * 100


def test_each_other_cause_names_its_own_remedy():
    cases = {
        "token_budget": ("max_num_batched_tokens (512)", "raising max_num_batched_tokens"),
        "kv_blocks": ("was free KV blocks (KV peak 100 %, 3 preemptions)", "raising max_num_seqs would not"),
        "partial_prefills": ("max_num_partial_prefills (1)", "raising max_num_partial_prefills"),
        "long_partial_prefills": ("max_long_partial_prefills (1)", "raising max_long_partial_prefills"),
    }
    for cause, (named, remedy) in cases.items():
        text = holding.reading(totals(**{cause: 6.0, "max_num_seqs": 4.0}), "w", KNOBS, 1.0, preemptions=3)
        assert text.startswith("60 % of the 10.0 request-s") and named in text and remedy in text, text


def test_a_split_window_names_no_single_limit():
    text = holding.reading(totals(max_num_seqs=4.0, token_budget=3.5, kv_blocks=2.5), "the last 1 min", KNOBS, 0.5)
    assert text == ("Queueing in the last 1 min (10.0 request-s) was split: max_num_seqs 40 %, token budget 35 %, "
                    "free KV blocks 25 %; no single limit held most of it.")
    assert "should" not in text


def test_a_knob_changed_in_the_window_is_named_with_its_current_value():
    text = holding.reading(totals(max_num_seqs=1.0), "w", KNOBS, 0.1, knobs_changed=True)
    assert "max_num_seqs (now 24)" in text


def _row(i: int, t: float, duration: float, **held: int) -> IterationStats:
    base = {m.name: 0 for m in ITERATION_METRICS}
    base.update(iteration=i, started_at=t, duration_s=duration, policy="continuous",
                **{HoldCause[k.upper()].column: v for k, v in held.items()})
    return IterationStats(**base)


def test_held_time_weights_each_iteration_by_its_step_time(tmp_path):
    url = f"sqlite:///{tmp_path / 'held.db'}"
    store.upgrade(url)
    writer = TelemetryWriter(url, "r1", flush_interval_s=0.05).start()
    t0 = 1_000_000.0
    writer.on_iteration(_row(0, t0 + 0.5, 0.1, max_num_seqs=3))  # 0.3 request-s
    writer.on_iteration(_row(1, t0 + 1.5, 0.4, max_num_seqs=1, kv_blocks=2))  # 0.4 + 0.8
    writer.on_iteration(_row(2, t0 + 5.5, 1.0, long_partial_prefills=1))  # 1.0
    writer.on_iteration(_row(3, t0 + 20.0, 9.0, token_budget=9))  # outside the window
    assert writer.flush()
    writer.close()
    held = queries.held_time(url, t0, t0 + 10, points=10)
    assert held.totals == pytest.approx({C.MAX_NUM_SEQS: 0.7, C.TOKEN_BUDGET: 0.0, C.KV_BLOCKS: 0.8,
                                         C.PARTIAL_PREFILLS: 0.0, C.LONG_PARTIAL_PREFILLS: 1.0})
    assert [t for t, _ in held.points] == pytest.approx([t0, t0 + 1, t0 + 5])
    assert held.points[1][1][C.KV_BLOCKS] == pytest.approx(0.8)
    xs, ys = holding.stacked(held)
    assert xs == pytest.approx([t0 + 0.5, t0 + 1.5, t0 + 5.5]) and ys[C.MAX_NUM_SEQS] == pytest.approx([0.3, 0.4, 0.0])
    with pytest.raises(ValueError, match="points"):
        queries.held_time(url, t0, t0 + 10, points=0)


@pytest.mark.parametrize("held, kv_peak, knobs, changes", [
    ({"max_num_seqs": 8.0}, 0.3, KNOBS, {"max_num_seqs": 48}),
    ({"max_num_seqs": 8.0}, 0.3, {**KNOBS, "max_num_batched_tokens": 32}, {"max_num_seqs": 48, "max_num_batched_tokens": 48}),
    ({"max_num_seqs": 8.0}, 0.85, KNOBS, None),  # the cache has no room: the reading promises nothing
    ({"max_num_seqs": 8.0}, None, KNOBS, None),
    ({"token_budget": 8.0}, 0.9, KNOBS, {"max_num_batched_tokens": 1024}),
    ({"partial_prefills": 8.0}, 0.9, KNOBS, {"max_num_partial_prefills": 2}),
    ({"long_partial_prefills": 8.0}, 0.9, KNOBS, {"max_long_partial_prefills": 2, "max_num_partial_prefills": 2}),
    ({"long_partial_prefills": 8.0}, 0.9, {**KNOBS, "max_num_partial_prefills": 3}, {"max_long_partial_prefills": 2}),
    ({"kv_blocks": 8.0}, 1.0, KNOBS, None),  # no knob adds memory
    ({"max_num_seqs": 4.0, "token_budget": 3.5, "kv_blocks": 2.5}, 0.3, KNOBS, None),  # split: no single limit
    ({}, 0.3, KNOBS, None),
])
def test_the_raise_put_to_the_whatif_is_the_one_the_reading_recommends(held, kv_peak, knobs, changes):
    assert holding.raise_to_try(totals(**held), knobs, kv_peak) == changes
    if changes:  # the reading says that raise should help
        assert "raising " + next(iter(changes)) in holding.reading(totals(**held), "w", knobs, kv_peak)


def _report(before: float, after: float, **summary_missing: bool) -> dict:
    def outcome(p99: float, knobs: dict, missing: bool) -> dict:
        return {"knobs": knobs} if missing else {"knobs": knobs, "summary": {"ttft": {"p50": p99 / 2, "p99": p99}}}
    return {"baseline": outcome(before, KNOBS, summary_missing.get("baseline", False)),
            "predicted": outcome(after, {**KNOBS, "max_num_seqs": 48}, summary_missing.get("predicted", False)),
            "knobs": {**KNOBS, "max_num_seqs": 48}, "model": {"heldout_mape": 0.062}}


def test_the_forecast_sentence_names_both_replays_the_knob_and_the_models_error():
    assert holding.forecast_sentence(_report(2.1, 0.93), "the last 5 min") == (
        "The what-if replay of the last 5 min predicts TTFT p99 2.1 s → 930 ms with max_num_seqs 24 → 48 "
        "(step-time model held-out error 6 %).")
    # a prediction of no gain is said as plainly
    assert "TTFT p99 850 ms → 1.2 s" in holding.forecast_sentence(_report(0.85, 1.2), "run r")
    assert holding.forecast_sentence(_report(2.1, 0.9, predicted=True), "w") is None
    assert holding.forecast_sentence(_report(2.1, 0.9, baseline=True), "w") is None
    text = holding.reading(totals(max_num_seqs=8.0), "w", KNOBS, 0.3, forecast="The what-if replay of w predicts X.")
    assert text.endswith("raising max_num_seqs should help. The what-if replay of w predicts X.")


def test_forecasts_run_in_the_background_once_per_view_raise_and_knobs_until_due():
    import threading

    from ui.api_client import ApiError
    from ui.holding_forecast import Forecasts, Source

    calls: list[tuple[dict, dict]] = []
    gate = threading.Event()
    answer: list[object] = [_report(2.1, 0.9)]

    def simulate(changes, **source):
        gate.wait(10)
        calls.append((changes, source))
        if isinstance(answer[0], Exception):
            raise answer[0]
        return answer[0]

    clock = [0.0]
    forecasts = Forecasts(simulate, every_s=60, clock=lambda: clock[0])
    src, raise_ = Source("the last 5 min", minutes=5.0), {"max_num_seqs": 48}
    assert forecasts.sentence("v", src, None, 1) is None and not calls  # nothing recommended: no replay
    assert forecasts.sentence("v", src, raise_, 1) is None  # started, not finished: the tick does not wait
    assert forecasts.sentence("v", src, raise_, 1) is None  # one replay at a time
    gate.set()
    forecasts.wait(10)
    assert calls == [({"max_num_seqs": 48}, {"run_id": None, "last_minutes": 5.0})]
    first = forecasts.sentence("v", src, raise_, 1)
    assert first.startswith("The what-if replay of the last 5 min predicts TTFT p99 2.1 s → 900 ms")
    clock[0] = 59.0
    assert forecasts.sentence("v", src, raise_, 1) == first and len(calls) == 1  # not due yet
    assert forecasts.sentence("v", src, raise_, 2) is None  # the knobs changed: the old forecast is not theirs
    forecasts.wait(10)
    assert len(calls) == 2 and forecasts.sentence("v", src, raise_, 2) == first
    clock[0] = 200.0
    answer[0] = ApiError("no matching iterations", 422)  # a rejected replay leaves the reading without one
    assert forecasts.sentence("v", src, raise_, 2) == first  # the last one stands while the next runs
    forecasts.wait(10)
    assert len(calls) == 3 and forecasts.sentence("v", src, raise_, 2) is None
