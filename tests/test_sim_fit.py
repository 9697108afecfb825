"""The step-time fit (appliance.sim.fit) on synthetic iteration rows with known coefficients."""

from __future__ import annotations

import random

import pytest

from appliance.sim.fit import FEATURES, INTERCEPT, MIN_ROWS, EngineKey, FitError, fit_step_time, loop_gap

KEY = EngineKey("m", "float32", "cpu", True, 2)
TRUE = {INTERCEPT: 0.004, "decode_rows": 0.0006, "prefill_tokens": 0.00021, "prefill_seqs": 0.0015,
        "decode_context_tokens": 0.0000035}
GAP = 0.0007


def synthetic_rows(n: int, noise: float, seed: int = 0, true: dict[str, float] = TRUE, max_chunks: int = 3) -> list[dict]:
    """Iteration rows whose duration is `true`'s linear function of a random composition (at most
    `max_chunks` prefill chunks a step), times (1 + uniform noise), started back to back GAP apart."""
    rng = random.Random(seed)
    rows, t = [], 1000.0
    for i in range(n):
        decode = rng.randint(0, 64)
        prefill_seqs = rng.randint(0, max_chunks)
        prefill = rng.randint(prefill_seqs, 200 * prefill_seqs) if prefill_seqs else 0
        context = decode * rng.randint(20, 600)
        exact = true[INTERCEPT] + true["decode_rows"] * decode + true["prefill_tokens"] * prefill + \
            true["prefill_seqs"] * prefill_seqs + true["decode_context_tokens"] * context
        duration = exact * (1 + rng.uniform(-noise, noise))
        rows.append({"iteration": i, "started_at": t, "duration_s": duration, "running": 3, "waiting": 0,
                     "decode_seqs": decode, "padding_tokens": 0, "prefill_tokens": prefill,
                     "prefill_seqs": prefill_seqs, "decode_context_tokens": context})
        t += duration + GAP
    return rows


def test_exact_rows_give_back_the_coefficients_and_the_gap():
    model = fit_step_time(synthetic_rows(200, noise=0.0), KEY, replica_id="r")
    for name in (INTERCEPT, *FEATURES):
        assert model.coefficients[name] == pytest.approx(TRUE[name], rel=1e-6), name
    assert model.gap_s == pytest.approx(GAP, rel=1e-6)
    assert model.heldout_mape < 1e-6
    assert (model.rows_used, model.rows_held_out) == (160, 40)
    assert model.key == KEY and model.replica_id == "r"


def test_noisy_rows_give_coefficients_within_tolerance_and_an_honest_heldout_error():
    model = fit_step_time(synthetic_rows(2000, noise=0.05, seed=1), KEY)
    # 5 % uniform noise on 1,600 rows: the well-determined slopes land within a few percent.
    for name in ("decode_rows", "prefill_tokens", "decode_context_tokens"):
        assert model.coefficients[name] == pytest.approx(TRUE[name], rel=0.05), name
    assert model.coefficients[INTERCEPT] == pytest.approx(TRUE[INTERCEPT], rel=0.25)
    # mean |uniform(-5 %, 5 %)| is 2.5 %: the held-out error says so
    assert 0.015 < model.heldout_mape < 0.035


def test_a_feature_that_buys_no_heldout_accuracy_is_left_out_and_one_that_pays_is_kept():
    # one prompt prefilled at a time and no real price per chunk: a chunk price would only be the
    # jump from a decode-only step to a prefill step, which smaller chunks would multiply
    one_chunk = synthetic_rows(1000, noise=0.1, seed=3, true={**TRUE, "prefill_seqs": 0.0}, max_chunks=1)
    model = fit_step_time(one_chunk, KEY)
    assert model.coefficients["prefill_seqs"] == 0.0
    assert model.method.endswith(" -chunks"), model.method
    assert model.coefficients["decode_context_tokens"] == pytest.approx(TRUE["decode_context_tokens"], rel=0.1)
    # chunks that vary and cost something: priced
    model = fit_step_time(synthetic_rows(1000, noise=0.1, seed=3), KEY)
    assert "-" not in model.method, model.method
    assert model.coefficients["prefill_seqs"] == pytest.approx(TRUE["prefill_seqs"], rel=0.5)


def test_static_padding_rows_count_as_decode_rows():
    rows = synthetic_rows(100, noise=0.0)
    for r in rows:  # move part of the decode rows into padding: same cost
        r["padding_tokens"], r["decode_seqs"] = r["decode_seqs"] // 2, r["decode_seqs"] - r["decode_seqs"] // 2
    model = fit_step_time(rows, KEY)
    assert model.coefficients["decode_rows"] == pytest.approx(TRUE["decode_rows"], rel=1e-6)


def test_too_few_usable_rows_is_an_error_naming_the_count():
    rows = synthetic_rows(MIN_ROWS + 5, noise=0.0)
    for r in rows[:10]:
        r["decode_context_tokens"] = None  # stored before the metric existed
    with pytest.raises(FitError, match=rf"^{MIN_ROWS - 5} usable iterations \(10 lack decode_context_tokens"):
        fit_step_time(rows, KEY)
    with pytest.raises(FitError, match="0 usable iterations"):
        fit_step_time([], KEY)


def test_gap_ignores_idle_waits_and_restarts():
    rows = synthetic_rows(10, noise=0.0)
    rows[3]["running"] = 0  # idle after iteration 3: the wait before 4 is not loop time
    rows[4]["started_at"] += 5.0
    rows[7]["iteration"] = 0  # a restart: not back to back
    assert loop_gap(rows) == pytest.approx(GAP)
    assert loop_gap(rows[:1]) == 0.0


def test_predictions_never_go_below_the_floor():
    model = fit_step_time(synthetic_rows(100, noise=0.0), KEY)
    model.coefficients[INTERCEPT] = -1.0
    from appliance.sim.fit import MIN_STEP_S, Composition

    assert model.predict(Composition(0, 0, 0, 0)) == MIN_STEP_S


def test_the_spread_of_step_times_is_kept_as_percentiles_and_drawn_by_quantile():
    from appliance.sim.fit import Composition

    exact = fit_step_time(synthetic_rows(200, noise=0.0), KEY)
    assert exact.noise == pytest.approx([1.0] * 101)  # no spread: every ratio is 1
    model = fit_step_time(synthetic_rows(4000, noise=0.2, seed=2), KEY)
    # durations are exact * (1 + uniform(-0.2, 0.2)): the ratios' percentiles follow that uniform,
    # up to the fit's own error (a few percent here) and sampling (3,200 fitted rows)
    assert len(model.noise) == 101 and list(model.noise) == sorted(model.noise)
    for q in (10, 25, 50, 75, 90):
        assert model.noise[q] == pytest.approx(0.8 + 0.4 * q / 100, abs=0.04), q
    c = Composition(8, 64, 1, 2000)
    assert model.step(c, 0.5)[0] == pytest.approx(model.predict(c) * model.noise[50])
    assert model.step(c, 0.9)[0] == pytest.approx(model.predict(c) * model.noise[90])
    assert model.step(c, 0.25)[0] < model.step(c, 0.75)[0]
    model.noise = ()  # a model stored before the spread was kept: its point estimate
    assert model.step(c, 0.99)[0] == model.predict(c)
