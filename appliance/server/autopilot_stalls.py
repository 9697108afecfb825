"""The autopilot's answer to prefill stalls it cannot replay: before its window holds enough
finished requests (at the start, and after each move, whose window starts empty), and when the
window's replay is not trusted (a replay of the finished requests alone misses the stalls that
requests still in flight caused).

A decode row waits for every step that also carries other prompts' prefill chunks; when such a
step takes longer than the ITL target, every stream in flight misses it, and the iterations show
that at once, long before five requests have finished. The chunk (long_prefill_token_threshold)
bounds those steps: the step-time model fitted on the window's own iterations predicts the
stalled step of the heaviest composition again with its prefill chunks capped at each halving of
the chunk, at the 99th percentile of the fit's own spread (the target is a p99), and the largest
chunk predicted under the target with the model's held-out error to spare is the move. Stalls
the model does not predict from their steps' composition, at a tail of its spread that one slow
step cannot set (the machine, not the chunk), or that no chunk down to the operator's lower bound
(and never under one KV block) brings under the target, move nothing here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from appliance.engine.knobs import Knobs
from appliance.records import IterationStats
from appliance.sim.fit import EngineKey, FitError, StepTimeModel, composition_of, fit_step_time

from .autopilot_policy import Choice, Spec, bounded_move, decode_waits

KNOB = "long_prefill_token_threshold"
TAIL = 0.99  # the quantile of the fit's spread a stall is predicted at (the target is a p99)


def tail_quantile(rows: int) -> float:
    """TAIL, or lower in a window too small for it: at least two fitted rows lie above it, so one
    hiccup of the machine (which may be the very stall in question) does not set it; for judging
    whether a stall is the chunk's."""
    return min(TAIL, 1 - 2 / max(rows, 3))


def stalled_steps(iterations: Sequence[IterationStats], target: float) -> list[tuple[IterationStats, float]]:
    """The steps that carried prefill chunks and kept their decode rows waiting longer than
    `target` (from the previous step's end to their own), with that wait."""
    return [(it, wait) for it, wait in decode_waits(iterations) if it.prefill_tokens > 0 and wait > target]


def chunk_cut(iterations: Sequence[IterationStats], knobs: Knobs, spec: Spec, fixed: Mapping[str, Any],
              model: StepTimeModel | None = None) -> Choice | None:
    """The choice for a window whose prefill steps stalled decoding past the ITL target (`fixed`:
    the engine's fixed settings, which key the step-time model; `model`: that model fitted on
    these iterations, when the caller has it); None when there is no ITL target or no such stall."""
    target = spec.targets.get("itl_p99")
    stalls = stalled_steps(iterations, target) if target else []
    if not stalls:
        return None
    wait = max(w for _, w in stalls)
    seen = f"{len(stalls)} step(s) carrying prefill chunks kept decode rows waiting up to {wait * 1000:.0f} ms " \
           f"(ITL target {target * 1000:.0f} ms)"
    try:
        model = model or fit_step_time([it.as_dict() for it in iterations], EngineKey.from_fixed(fixed))
    except FitError as exc:
        return Choice(None, f"hold: {seen}, but {exc}")
    # the stalled step whose composition the model predicts slowest (a hiccup of the machine
    # may have made another one wait longer), as its decode rows wait for it: the step at the
    # fit's tail, and the engine's gap before it. Whether the chunk causes it is judged at a tail
    # that one slow step cannot set (in a small window the p99 would be that step); how deep to
    # cut, at the p99 (the target is one)
    now = max((composition_of(it.as_dict()) for it, _ in stalls), key=model.predict)

    def wait_at(chunk: int, tail: float) -> float:
        capped = replace(now, prefill_tokens=min(now.prefill_tokens, chunk * max(1, now.prefill_seqs)))
        return model.predict(capped) * model.ratio(tail) + model.gap_s

    chunk = knobs.long_prefill_token_threshold
    if (robust := wait_at(chunk, tail_quantile(model.rows_used))) <= target:
        return Choice(None, f"hold: {seen}; the step-time model predicts at most {robust * 1000:.0f} ms for "
                            f"their compositions (at the tail of its spread): the stall is not the chunk's")
    predicted = {chunk: wait_at(chunk, TAIL)}
    # kept only with the model's held-out error to spare, as the replayed choice counts it
    headroom = 1 + model.heldout_mape
    # halvings down to the operator's lower bound, and never under one KV block (smaller chunks
    # pay a step's fixed cost for a sliver of a prompt)
    floor = max(1, spec.bounds.get(KNOB, (1, 0))[0], int(fixed.get("block_size") or 1))
    while predicted[chunk] * headroom > target and (smaller := max(floor, chunk // 2)) < chunk:
        chunk = smaller
        predicted[chunk] = wait_at(chunk, TAIL)
    prediction = {"stalled_steps": len(stalls), "worst_wait_s": wait, "model_heldout_mape": model.heldout_mape,
                  "predicted_wait_s": {str(c): t for c, t in predicted.items()}}
    if chunk == knobs.long_prefill_token_threshold:
        return Choice(None, f"hold: {seen}; the chunk is at its bound", prediction)
    if predicted[chunk] * headroom > target:
        return Choice(None, f"hold: {seen}; no chunk down to {chunk} tokens brings that step under the target "
                            f"(the step-time model predicts {predicted[chunk] * 1000:.0f} ms with {chunk}-token "
                            f"chunks)", prediction)
    move = bounded_move(knobs, spec, KNOB, chunk, f"{seen}; the step-time model (held-out error "
                        f"{model.heldout_mape:.0%}) predicts the heaviest at {predicted[chunk] * 1000:.0f} ms with "
                        f"{chunk}-token chunks (p99 of its spread)")
    return Choice(move, move.reason, prediction) if move else Choice(None, f"hold: {seen}; the chunk is at its bound",
                                                                      prediction)
