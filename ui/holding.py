"""What is holding traffic back: the share of queued request-time by the limit that held it
(appliance.records.HoldCause, counted by the scheduler each iteration), and a one-line reading
of it that says only what those numbers show.

Pure functions over query results (appliance.telemetry.queries.HeldTime): no I/O here.
"""

from __future__ import annotations

import math
from typing import Any

from appliance.records import HoldCause
from appliance.telemetry.queries import HeldTime

DOMINANT = 0.5  # a cause with at least this share of the queueing is named as the one that binds
KV_ROOM = 0.8  # below this peak KV usage, admitting more sequences has room in the cache

LABELS = {
    HoldCause.MAX_NUM_SEQS: "max_num_seqs",
    HoldCause.TOKEN_BUDGET: "token budget",
    HoldCause.KV_BLOCKS: "free KV blocks",
    HoldCause.PARTIAL_PREFILLS: "max_num_partial_prefills",
    HoldCause.LONG_PARTIAL_PREFILLS: "max_long_partial_prefills",
}


def shares(totals: dict[HoldCause, float]) -> dict[HoldCause, float]:
    """Each cause's share of the queued request-time (empty when nothing waited)."""
    total = sum(totals.values())
    return {cause: value / total for cause, value in totals.items()} if total > 0 else {}


def stacked(held: HeldTime) -> tuple[list[float], dict[HoldCause, list[float]]]:
    """Bucket midpoints and request-seconds per cause, for buckets in which something waited."""
    xs: list[float] = []
    ys: dict[HoldCause, list[float]] = {cause: [] for cause in HoldCause}
    for t, by_cause in held.points:
        if sum(by_cause.values()) <= 0:
            continue
        xs.append(t + held.bucket_s / 2)
        for cause in HoldCause:
            ys[cause].append(by_cause.get(cause, 0.0))
    return xs, ys


def _knob(cause: HoldCause, knobs: dict[str, Any], changed: bool) -> str:
    if cause is HoldCause.KV_BLOCKS or cause.value not in knobs:
        return LABELS[cause]
    return f"{cause.value} ({'now ' if changed else ''}{knobs[cause.value]})"


def _ranked(totals: dict[HoldCause, float]) -> list[tuple[float, HoldCause]]:
    """(share, cause) of every cause that held something, largest first (ties in HoldCause order)."""
    total = sum(totals.values())
    return sorted(((v / total, c) for c, v in totals.items() if v > 0), key=lambda x: (-x[0], list(HoldCause).index(x[1])))


def reading(totals: dict[HoldCause, float], where: str, knobs: dict[str, Any], kv_peak: float | None,
            preemptions: int = 0, knobs_changed: bool = False, forecast: str | None = None) -> str:
    """One line on what held traffic back `where` ("the last 5 min", "run smoke").

    totals: queued request-seconds by cause; knobs: the values in force (named "now" when
    `knobs_changed` in the window); kv_peak: the highest KV usage in the window (0..1, None if
    unknown); preemptions: in the window; forecast: the what-if's sentence on `raise_to_try`
    (forecast_sentence), appended. A cause is named as binding only with at least DOMINANT of
    the queueing, and a knob is said to help only where the numbers leave room."""
    total = sum(totals.values())
    if total <= 0:
        return f"No request waited in {where}: no limit held traffic back."
    ranked = _ranked(totals)
    share, cause = ranked[0]
    head = f"{_pct(share)} of the {total:.1f} request-s of queueing in {where} was {_knob(cause, knobs, knobs_changed)}"
    if share < DOMINANT:
        parts = ", ".join(f"{LABELS[c]} {_pct(s)}" for s, c in ranked[:3])
        return f"Queueing in {where} ({total:.1f} request-s) was split: {parts}; no single limit held most of it."
    line = _remedy(cause, head, kv_peak, preemptions)
    return f"{line} {forecast}" if forecast else line


def _remedy(cause: HoldCause, head: str, kv_peak: float | None, preemptions: int) -> str:
    kv = _kv(kv_peak)
    if cause is HoldCause.MAX_NUM_SEQS:
        if kv_peak is None:
            return f"{head} (KV usage unknown): raising max_num_seqs may help if the KV cache has room."
        if kv_peak < KV_ROOM:
            return f"{head} while KV usage stayed under {_ceil10(kv_peak)} %: raising max_num_seqs should help."
        return (f"{head} but KV usage reached {kv}: raising max_num_seqs would likely trade queueing for "
                "preemptions; more KV memory would help.")
    if cause is HoldCause.TOKEN_BUDGET:
        return (f"{head}: raising max_num_batched_tokens should let more requests start per iteration "
                "(each step gets longer).")
    if cause is HoldCause.KV_BLOCKS:
        pre = f", {preemptions} preemption{'s' if preemptions != 1 else ''}" if preemptions else ""
        return (f"{head} (KV peak {kv}{pre}): the cache is what binds; more KV memory (--kv-cache-memory, "
                "--num-blocks) would help, raising max_num_seqs would not.")
    if cause is HoldCause.PARTIAL_PREFILLS:
        return (f"{head}: prompts waited for an unfinished prefill; raising max_num_partial_prefills "
                "(or long_prefill_token_threshold) should help.")
    return (f"{head}: long prompts waited for a long-prefill slot; raising max_long_partial_prefills "
            "should start them sooner (at some cost to short prompts).")


def raise_to_try(totals: dict[HoldCause, float], knobs: dict[str, Any], kv_peak: float | None) -> dict[str, int] | None:
    """The raise the reading recommends, as knob changes to put to the what-if simulator: the
    binding limit doubled (max_num_seqs, with the budget raised to match where it would fall
    under it; the token budget) or one more prefill slot (with max_num_partial_prefills raised
    to match a long slot). None where the reading recommends no raise: queueing split, held by
    free KV blocks, max_num_seqs with the cache at KV_ROOM or unknown, or a knob not in `knobs`."""
    if sum(totals.values()) <= 0:
        return None
    share, cause = _ranked(totals)[0]
    if share < DOMINANT or cause is HoldCause.KV_BLOCKS or cause.value not in knobs:
        return None
    if cause is HoldCause.MAX_NUM_SEQS and (kv_peak is None or kv_peak >= KV_ROOM):
        return None
    value = int(knobs[cause.value])
    if cause is HoldCause.MAX_NUM_SEQS:
        budget = int(knobs.get("max_num_batched_tokens", 2 * value))
        return {cause.value: 2 * value} | ({"max_num_batched_tokens": 2 * value} if budget < 2 * value else {})
    if cause is HoldCause.TOKEN_BUDGET:
        return {cause.value: 2 * value}
    changes = {cause.value: value + 1}
    partial = int(knobs.get("max_num_partial_prefills", value + 1))
    if cause is HoldCause.LONG_PARTIAL_PREFILLS and partial < value + 1:
        changes["max_num_partial_prefills"] = value + 1
    return changes


def forecast_sentence(report: dict[str, Any], where: str) -> str | None:
    """The what-if's answer (a POST /admin/simulate report) as one sentence: TTFT p99 replayed at
    the knobs `where` started with and at the raise, the knobs that changed, and the step-time
    model's held-out error; None when either replay has no summary."""
    base, predicted = report["baseline"].get("summary"), report["predicted"].get("summary")
    if not base or not predicted:
        return None
    before, after = report["baseline"].get("knobs", {}), report["knobs"]
    changed = ", ".join(f"{k} {before.get(k)} → {v}" for k, v in after.items() if before.get(k) != v)
    error = report["model"]["heldout_mape"]
    return (f"The what-if replay of {where} predicts TTFT p99 {_seconds(base['ttft']['p99'])} → "
            f"{_seconds(predicted['ttft']['p99'])} with {changed} (step-time model held-out error {_pct(error)}).")


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value >= 1 else f"{value * 1000:.0f} ms"


def _pct(share: float) -> str:
    return f"{round(share * 100)} %"


def _ceil10(fraction: float) -> int:
    """The next multiple of 10 % strictly above `fraction` (0.37 -> 40, 0.40 -> 50)."""
    return min(100, (math.floor(fraction * 100 / 10) + 1) * 10)


def _kv(fraction: float | None) -> str:
    return "unknown" if fraction is None else f"{round(fraction * 100)} %"
