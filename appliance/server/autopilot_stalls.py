"""The autopilot's answer to prefill stalls, before any replay: a replay takes seconds and knows
the streams still in flight only by the outputs it estimates for them, and before the window
holds enough finished requests (at the start, and after each move, whose window starts empty)
there is nothing to replay.

A decode row waits for every step that also carries other prompts' prefill chunks; when such a
step takes longer than the ITL target, every stream in flight misses it, and the iterations show
that at once, long before five requests have finished. The chunk (long_prefill_token_threshold)
bounds those steps: the step-time model fitted on the window's own iterations predicts the
stalled step of the heaviest composition again with its prefill chunks capped at each smaller
chunk in whole KV blocks, at the 99th percentile of the fit's own spread (the target is a p99),
and the largest chunk predicted under the target with the model's held-out error to spare is the
move (not the largest halving: a chunk cut deeper than the target needs costs every long prompt
prefill capacity, since each step pays its fixed cost for fewer tokens). A stalled step of
several prompts' prefill is bounded whole by the token budget instead, cut the same way with the
chunk brought under it (`step_bound`: a prompt that fits a chunk rides whole). Stalls the
model does not predict from their steps' composition, at a tail of its spread that one slow step
cannot set (the machine, not the chunk), or that no chunk down to the operator's lower bound (and
never under one KV block) brings under the target even at the median of the fit's spread, move
nothing here (a bound kept at the median only is still the cut). With the chunk already at that
floor, a stalled step that carried several prompts' chunks (a prompt's last chunk and the next
prompt's first ride together) is bounded by their number: max_num_partial_prefills is cut as the
chunk would be (`prefills_cut`); one that carried more prompts than that limit is bounded by the
token budget (`budget_cut`: short prompts finish in their step and never count toward the limit).
Else the decode rows beside it bound the stalled step: the
largest max_num_seqs under which the model predicts it under the target is the move (`seqs_cut`;
benchmarks/autopilot.py run 37: with 64-token chunks and up to 16 sequences running, 58 prefill
steps in 30 s of long prompts kept decode rows past 150 ms; the best fixed setting, 8 sequences,
13), but never under the sequences the window ran on average (`seqs_demand`: fewer would let the
queue grow). Such a window is not even fitted when no max_num_seqs under what the stalled steps
ran is left above both that mean and the operator's lower bound, nor a limit on the prompts
prefilled at once under the most they carried (the fit is tens of milliseconds of Python in the
server's process, which the engine's thread then waits on for the GIL), and a fit at the floor is
spaced out like a replay.

The model also sees a stall coming (`foresight`): a whole chunk beside the most decode rows the
window has run is predicted (before it has run any, the most the engine ran in its latest steps
before the window, as far as it has requests still in flight, `still_in_flight`, else one:
benchmarks/autopilot.py run 77, priced beside one decode row, cut a 256-token chunk to 224 only,
and 13 chat requests missed ITL before a stall cut it to 80); a
chunk whose step would miss the target at the tail of the fit's spread (the quantile that judges
a stall the chunk's) is cut the same way before the first prompt that long arrives
(benchmarks/autopilot.py run 75: a whole 256-token chunk priced just under the 150 ms target at
the median did not fire, and 14 chat requests missed ITL before stalls of 154-254 ms cut it).
The model is the window's own once the window has priced prefill tokens, else the one fitted on
the engine's latest steps from before it (`kept`: what a step costs is the machine's and the
model's, whichever knobs shaped it), so that a window that starts empty (when the autopilot is
switched on, and after each move) does not wait for the first stall to price a chunk
(benchmarks/autopilot.py runs 59-63: the window's own fit came 3.6-4.2 s into the run, after the
first 256-token prefill beside a stream; the autopilot's ways missed 2 requests each on ITL in
the chat phase, the best fixed setting 0.2).

The same model bars a raise of the prompts prefilled at once (`raise_stalls`): each one more puts
another chunk beside the decode rows (a raise of the chunk, which TTFT also asks for when such a
limit holds the queue, a larger one; of the token budget, more of the prompts' tokens), and a raise
that TTFT asks for must not buy the queued prompts' first tokens with a stall of every stream in
flight (benchmarks/autopilot.py runs 34-35: max_long_partial_prefills 1→2 during the long prompts,
and ITL misses all through that phase). It is barred unless the step it allows keeps the target at
the p99 of the fit's spread with the held-out error to spare, as a stall cut's step must: a raise
the stall answer would cut again is not made. But not while the queue starves (TTFT p99 at twice
its target or more: every request it holds has missed the SLO already, however it streams) and the
raise only gives back what the autopilot's own cuts took (up to the operator's value: the knobs in
force when it was switched on or a person last changed them): then the raise is made, and no stall
cut undoes a raise in force (`kept_raise`); the relax rule gives it back once both targets are
kept. Past the operator's value the bar stands even then: over capacity such a raise puts a second
chunk beside every stream without emptying the queue, and the streams miss ITL for as long as it
lasts (benchmarks/autopilot.py runs 85 and 87: max_long_partial_prefills 1→2 over a starving queue,
then ITL misses there and in the short prompts' phase that the best fixed setting did not have).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from appliance.engine.knobs import Knobs
from appliance.records import IterationStats, RequestStats
from appliance.sim.fit import Composition, EngineKey, FitError, StepTimeModel, composition_of, fit_step_time

from .autopilot_policy import (Choice, Move, Spec, bounded_move, bounded_moves, decode_waits, kept_raise,
                               running_mean, seqs_demand)

KNOB = "long_prefill_token_threshold"
SEQS = "max_num_seqs"
BUDGET = "max_num_batched_tokens"
PREFILLS = "max_num_partial_prefills"
PREFILLS_AT_ONCE = (PREFILLS, "max_long_partial_prefills")
TAIL = 0.99  # the quantile of the fit's spread a stall is predicted at (the target is a p99)
MEDIAN = 0.5  # ...and the deepest cut the bounds allow, when none keeps the target at TAIL
MIN_PREFILL_STEPS = 3  # a window prices prefill tokens once this many of its steps carried some
STARVED = 2.0  # TTFT p99 at this many times its target: a raise up to the operator's value is not barred by its stall


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
              foresee: bool = True, kept: Sequence[IterationStats] = (),
              raised: Mapping[str, int] | None = None, in_flight: int = 0) -> Choice | None:
    """The choice for a window whose prefill steps stalled decoding past the ITL target, or
    (`foresee`), when the chunk has not yet, whose chunk the step-time model foresees doing so
    (`foresight`, which prices steps on `kept` when the window cannot, beside as many of their
    decode rows as the engine has requests `in_flight`). `fixed`: the engine's fixed
    settings, which key the step-time model; `raised`: the autopilot's last raise still in force
    ({knob: its value before}), which no stall cut undoes (`prefills_floor`, `seqs_floor`). None
    when there is no ITL target, no stall and none foreseen."""
    target = spec.targets.get("itl_p99")
    if not target:
        return None
    stalls = stalled_steps(iterations, target)
    if not stalls:
        return foresight(iterations, knobs, spec, fixed, kept=kept, raised=raised,
                         in_flight=in_flight) if foresee else None
    wait = max(w for _, w in stalls)
    seen = f"{len(stalls)} step(s) carrying prefill chunks kept decode rows waiting up to {wait * 1000:.0f} ms " \
           f"(ITL target {target * 1000:.0f} ms)"
    at_floor = knobs.long_prefill_token_threshold <= floor_of(spec, fixed, knobs, raised)
    ran = max(it.decode_seqs + it.prefill_seqs for it, _ in stalls)
    prompts = max(it.prefill_seqs for it, _ in stalls)
    demand = seqs_demand(running_mean(iterations))
    if prompts > knobs.max_num_partial_prefills:  # the token budget bounded that step
        prompts_at_floor = budget_floor(spec, knobs, raised) >= knobs.max_num_batched_tokens
    else:
        prompts_at_floor = prefills_floor(spec, knobs, raised) >= min(knobs.max_num_partial_prefills, prompts)
    if at_floor and max(seqs_floor(spec, knobs, raised), demand) >= min(knobs.max_num_seqs, ran) and prompts_at_floor:
        return Choice(None, f"hold: {seen}; the chunk is at its bound")
    try:
        model = fit_window(iterations, fixed)
    except FitError as exc:
        return Choice(None, f"hold: {seen}, but {exc}", simulated=at_floor)
    # the stalled step whose composition the model predicts slowest (a hiccup of the machine
    # may have made another one wait longer), as its decode rows wait for it: the step at the
    # fit's tail, and the engine's gap before it. Whether the chunk causes it is judged at a tail
    # that one slow step cannot set (in a small window the p99 would be that step); how deep to
    # cut, at the p99 (the target is one)
    now = max((composition_of(it.as_dict()) for it, _ in stalls), key=model.predict)
    chunk = knobs.long_prefill_token_threshold
    if (robust := wait_at(model, now, chunk, tail_quantile(model.rows_used))) <= target:
        ahead = foresight(iterations, knobs, spec, fixed, model, raised=raised) if foresee else None
        return ahead if ahead is not None and ahead.move is not None else Choice(
            None, f"hold: {seen}; the step-time model predicts at most {robust * 1000:.0f} ms for their "
                  f"compositions (at the tail of its spread): the stall is not the chunk's", simulated=at_floor)
    prediction = {"stalled_steps": len(stalls), "worst_wait_s": wait}
    if at_floor:
        if now.prefill_seqs > knobs.max_num_partial_prefills:  # prompts that finish in the step rode along
            bounded = budget_cut(model, now, knobs, spec, fixed, seen, prediction, raised, simulated=True,
                                 why=f"the chunk is at its bound and {now.prefill_seqs} prompts' prefill rode in "
                                     f"that step, past max_num_partial_prefills {knobs.max_num_partial_prefills} "
                                     "(prompts that finish in their step do not count toward it)")
        else:
            bounded = prefills_cut(model, now, knobs, spec, seen, prediction, raised)
        return bounded or seqs_cut(model, now, knobs, spec, seen, prediction, demand, raised)
    return step_bound(model, now, knobs, spec, fixed, seen, prediction, raised)


def foresight(iterations: Sequence[IterationStats], knobs: Knobs, spec: Spec, fixed: Mapping[str, Any],
              model: StepTimeModel | None = None, kept: Sequence[IterationStats] = (),
              raised: Mapping[str, int] | None = None, in_flight: int = 0) -> Choice | None:
    """Before the chunk has stalled decoding: it bounds the step a long prompt makes beside the
    decode rows in flight. The model (`model`, else the window's own fit once MIN_PREFILL_STEPS
    of its steps carried prefill tokens, else one on the engine's `kept` steps from before the
    window) predicts the heaviest decode step the window holds (before it holds any, the heaviest
    of the engine's `kept` steps with their decode rows and prompts cut to the `in_flight`
    requests: the traffic still in flight as the window started, `still_in_flight`; with none,
    one decode row) with each of its prefills (at least one) a whole chunk, within the token budget; if that
    step's decode rows would wait longer than the ITL target at the tail of the fit's spread
    (`tail_quantile`, as a stall is judged the chunk's), the chunk is cut as a stall would cut it,
    before the first long prompt makes one.
    With the chunk at its bound, the step predicted is the one the limit on prompts prefilled at
    once allows (that many whole chunks), and that limit is cut as a stall of it would cut it (the
    same foresight bars raising it there: `raise_stalls`), never under a raise in force (`raised`).
    None: nothing foreseen."""
    target = spec.targets["itl_p99"]
    chunk = knobs.long_prefill_token_threshold
    at_floor = chunk <= floor_of(spec, fixed, knobs, raised)
    if at_floor and knobs.max_num_partial_prefills <= prefills_floor(spec, knobs, raised):
        return None
    own = model or priced(iterations, fixed)
    if (model := own or priced(kept, fixed)) is None:
        return None
    decoding = [composition_of(it.as_dict()) for it in iterations if it.decode_seqs > 0]
    before = not decoding  # the window has run no decode step: the traffic in flight as it started
    if before:
        decoding = [c for it in kept if it.decode_seqs > 0
                    if (c := still_in_flight(composition_of(it.as_dict()), in_flight)) is not None]

    def with_full_chunks(c: Composition) -> Composition:
        prompts = knobs.max_num_partial_prefills if at_floor else max(1, c.prefill_seqs)
        return replace(c, prefill_seqs=prompts,
                       prefill_tokens=max(c.prefill_tokens, knobs.max_num_batched_tokens - c.decode_rows))

    tail = tail_quantile(model.rows_used)
    steps = [with_full_chunks(c) for c in decoding or [Composition(1, 0, 0, chunk)]]
    waits = [wait_at(model, c, chunk, tail) for c in steps]
    if (wait := max(waits)) <= target:
        return None
    ahead = steps[waits.index(wait)]
    if not decoding:
        beside = "one decode row"
    elif before:
        beside = f"the {ahead.decode_rows} decode rows the engine ran before this window and has still in flight"
    else:
        beside = f"the {ahead.decode_rows} decode rows the window has run"
    fitted = "" if own else ", fitted on the engine's steps before this window"
    seen = f"foreseen: {ahead.prefill_seqs} whole {chunk}-token chunk(s) beside {beside} would keep them waiting " \
           f"{wait * 1000:.0f} ms at the tail of the step-time model's spread{fitted} (ITL target " \
           f"{target * 1000:.0f} ms)"
    if at_floor:
        return prefills_cut(model, ahead, knobs, spec, seen, {"foreseen_wait_s": wait}, raised)
    return step_bound(model, ahead, knobs, spec, fixed, seen, {"foreseen_wait_s": wait}, raised)


def still_in_flight(step: Composition, requests: int) -> Composition | None:
    """`step`, one of the engine's from before the window, with its decode rows and its prompts
    each cut to the `requests` in flight now (their context and prefill tokens in proportion), or
    None when it keeps no decode row: rows whose requests have finished stall nothing, and prompts
    that came at once then are no sign of the next ones (benchmarks/autopilot.py runs 96-103: each
    second autopilot way, switched on over an idle engine, priced a whole chunk beside the 14-21
    decode rows of a load that had ended a minute before and cut the chunk to 64-112, where most
    chat and long prompts count as long and wait for the one long-prefill slot; all but run 98's
    lost to the best fixed setting measured beside them, mostly on TTFT in the long prompts'
    phase. Run 104: with the rows cut but not the prompts, 4 whole chunks beside one row, the
    warm-up's 4 prompts sent at once, cut the chunk 256→64, and chat TTFT p99 was 6.1 s at +76 s)."""
    rows, prompts = min(step.decode_rows, requests), min(step.prefill_seqs, requests)
    if rows <= 0:
        return None
    return replace(step, decode_rows=rows, decode_context_tokens=step.decode_context_tokens * rows // step.decode_rows,
                   prefill_seqs=prompts, prefill_tokens=step.prefill_tokens * prompts // max(1, step.prefill_seqs))


def raise_stalls(model: StepTimeModel, iterations: Sequence[IterationStats], requests: Sequence[RequestStats],
                 knobs: Knobs, spec: Spec, move: Move, ttft_p99: float | None,
                 operator: Mapping[str, Any] | None = None) -> str | None:
    """Why `move` is barred, or None: it raises a limit on the prompts prefilled at once to n, the
    chunk or the token budget, and the heaviest decode step of the window with its prefill chunks
    after the move beside it (n of them, or for a raise of the chunk or the budget as many as the
    step carried, at least one; each a whole chunk, or the window's longest prompt if shorter;
    within the token budget) would keep its decode rows waiting past the ITL target at the p99 of
    the fit's spread with the model's held-out error to spare: the test a stall cut passes, so that
    no raise is made that the stall answer would cut again (benchmarks/autopilot.py run 61: a raise
    of max_long_partial_prefills allowed at the median, 1→2, and ten seconds later the stall cut
    max_num_partial_prefills to 2). Not barred while the window's TTFT p99 (`ttft_p99`) is STARVED
    times its target or more and the raise goes no higher than the operator's value of the limit
    (`operator`: the knobs in force when the autopilot was switched on or a person last changed
    them; None: no raise is excepted): the queue then misses the SLO for every request it holds
    whatever their streaming, the raise gives back what the autopilot's own cut took, and a stall
    cut does not undo it (`kept_raise`; benchmarks/autopilot.py run 66: with
    max_num_partial_prefills cut to 1 in the chat phase, the long prompts' phase held 100 % of the
    queue on that limit, TTFT p99 reached 10.6 s, and every raise 1→2 was barred: 51 misses against
    the best fixed setting's 37 there). Past the operator's value the bar stands, starving or not
    (runs 85 and 87: see the module's doc)."""
    target = spec.targets.get("itl_p99")
    now = knobs.as_dict()
    raised = [(name, n) for name, n in move.changes.items()
              if name in (*PREFILLS_AT_ONCE, KNOB, BUDGET) and n > now[name]]
    decoding = [composition_of(it.as_dict()) for it in iterations if it.decode_seqs > 0]
    if not target or not raised or not decoding or not requests:
        return None
    starved = starves(ttft_p99, spec)
    operator = operator or {}
    if starved and all(value <= operator.get(limit, 0) for limit, value in raised):
        return None
    prefills = [(name, n) for name, n in raised if name in PREFILLS_AT_ONCE]
    name, n = max(prefills, key=lambda r: r[1]) if prefills else raised[0]
    after = knobs.with_changes(move.changes)
    size = min(after.long_prefill_token_threshold, max(r.prompt_tokens for r in requests))

    def with_chunks(c: Composition) -> Composition:
        prompts = n if prefills else max(1, c.prefill_seqs)
        return replace(c, prefill_seqs=prompts,
                       prefill_tokens=max(0, min(prompts * size, after.max_num_batched_tokens - c.decode_rows)))

    worst = max(map(with_chunks, decoding), key=lambda c: wait_at(model, c, size, TAIL))
    if (wait := wait_at(model, worst, size, TAIL)) * (1 + model.heldout_mape) <= target:
        return None
    past = (f"; the queue starves (TTFT p99 {ttft_p99:.1f} s), but {n} is past the operator's {operator[name]}"
            if starved and name in operator else "")
    return (f"{name} {now[name]}→{n} barred: {worst.prefill_seqs} prefill chunk(s) of {size} tokens beside the "
            f"{worst.decode_rows} decode rows the window has run would keep them waiting {wait * 1000:.0f} ms at the "
            f"p99 of the step-time model's spread (held-out error {model.heldout_mape:.0%}; ITL target "
            f"{target * 1000:.0f} ms){past}")


def starves(ttft_p99: float | None, spec: Spec) -> bool:
    """Whether a window's TTFT p99 is STARVED times its target or more: every request the queue
    holds has missed the SLO already, however it streams."""
    target = spec.targets.get("ttft_p99")
    return target is not None and ttft_p99 is not None and ttft_p99 >= STARVED * target


def priced(iterations: Sequence[IterationStats], fixed: Mapping[str, Any]) -> StepTimeModel | None:
    """The step-time model fitted on `iterations` once MIN_PREFILL_STEPS of them carried prefill
    tokens (it prices those); None before, or when they cannot be fitted."""
    if sum(it.prefill_tokens > 0 for it in iterations) < MIN_PREFILL_STEPS:
        return None
    try:
        return fit_window(iterations, fixed)
    except FitError:
        return None


def wait_at(model: StepTimeModel, step: Composition, chunk: int, tail: float) -> float:
    """How long the decode rows of `step` wait for it with its prefill chunks capped at `chunk`:
    the step at quantile `tail` of the fit's spread, plus the engine's gap before it."""
    capped = replace(step, prefill_tokens=min(step.prefill_tokens, chunk * max(1, step.prefill_seqs)))
    return model.predict(capped) * model.ratio(tail) + model.gap_s


def step_bound(model: StepTimeModel, step: Composition, knobs: Knobs, spec: Spec, fixed: Mapping[str, Any],
               seen: str, prediction: dict[str, Any], raised: Mapping[str, int] | None = None) -> Choice:
    """The cut for a `step` whose decode rows would wait past the ITL target, the chunk above its
    floor: the token budget's (`budget_cut`) when the step carried several prompts' prefill,
    else (or when no budget cut is to be had) the chunk's (`deepest_needed`). The chunk bounds each
    prompt's share of a step, not the step: a prompt that fits a chunk rides whole beside the
    others, and a cut that makes prompts long queues them for the long-prefill slots; a cut of
    the chunk keeps a step of k prompts at k chunks only while k prompts prefill at once, the
    budget's holds for any mix (benchmarks/autopilot.py run 114's second way: a step of 2 prompts'
    329 tokens beside 12 decode rows stalled 191 ms and the chunk was cut 192→64, under which
    every chat prompt (96-256 tokens) was long; 14 requests waited when the long prompts came,
    where the best fixed setting's 256-token budget kept 1-3, and that phase missed 272 requests
    against its 23. Rebuilt from its store, the budget's cut is 512→160, the chunk 160 with it)."""
    why = f"{step.prefill_seqs} prompts' prefill in that step, which the token budget bounds whole (a prompt " \
          "that fits a chunk rides whole)"
    if step.prefill_seqs > 1 and (cut := budget_cut(model, step, knobs, spec, fixed, seen, prediction, raised,
                                                     why=why, simulated=False)) is not None:
        return cut
    return deepest_needed(model, step, knobs, spec, fixed, seen, prediction, raised)


def deepest_needed(model: StepTimeModel, step: Composition, knobs: Knobs, spec: Spec, fixed: Mapping[str, Any],
                   seen: str, prediction: dict[str, Any], raised: Mapping[str, int] | None = None) -> Choice:
    """The largest chunk, in whole KV blocks, under which `step` keeps the ITL target at the p99
    of the fit's spread with the model's held-out error to spare, as the replayed choice (`pick`)
    counts it (every chunk tried is in the prediction); when none down to the bound does, the
    bound if it keeps the target at the median of the spread (most such steps would:
    benchmarks/autopilot.py run 42 held a 256-token chunk foreseen at 327 ms because 64 tokens
    were predicted at 149 ms, over 150 with the error to spare, and streams stalled until a
    replay cut it 4 s later); a hold when the chunk is at its bound or no chunk down to there
    keeps the target even at the median."""
    target = spec.targets["itl_p99"]
    chunk = knobs.long_prefill_token_threshold
    headroom = 1 + model.heldout_mape
    predicted = descend(chunk, floor_of(spec, fixed, knobs, raised), kv_block(fixed),
                        lambda c: wait_at(model, step, c, TAIL), target, headroom)
    chunk = list(predicted)[-1]
    prediction = {**prediction, "model_heldout_mape": model.heldout_mape,
                  "predicted_wait_s": {str(c): t for c, t in predicted.items()}}
    if chunk == knobs.long_prefill_token_threshold:
        return Choice(None, f"hold: {seen}; the chunk is at its bound", prediction)
    forecast = f"{predicted[chunk] * 1000:.0f} ms with {chunk}-token chunks (p99 of its spread)"
    if predicted[chunk] * headroom > target:
        if (median := wait_at(model, step, chunk, MEDIAN)) > target:
            return Choice(None, f"hold: {seen}; no chunk down to {chunk} tokens brings that step under the target "
                                f"(the step-time model predicts {predicted[chunk] * 1000:.0f} ms with {chunk}-token "
                                f"chunks, {median * 1000:.0f} ms at the median of its spread)", prediction)
        forecast += f", {median * 1000:.0f} ms at its median: the deepest cut the bounds allow"
    move = bounded_move(knobs, spec, KNOB, chunk, f"{seen}; the step-time model (held-out error "
                        f"{model.heldout_mape:.0%}) predicts {forecast}")
    return Choice(move, move.reason, prediction) if move else Choice(None, f"hold: {seen}; the chunk is at its bound",
                                                                      prediction)


def descend(start: int, floor: int, block: int, wait: Callable[[int], float], target: float,
            headroom: float) -> dict[int, float]:
    """`wait` at `start` and at each smaller value in whole `block`s down to `floor`, until one
    keeps `target` with `headroom` (a factor) to spare: {value: wait}, in that order (the last
    entry is the value reached)."""
    value, predicted = start, {start: wait(start)}
    while predicted[value] * headroom > target and (smaller := max(floor, (value - 1) // block * block)) < value:
        value = smaller
        predicted[value] = wait(value)
    return predicted


def seqs_cut(model: StepTimeModel, step: Composition, knobs: Knobs, spec: Spec, seen: str,
             prediction: dict[str, Any], demand: int, raised: Mapping[str, int] | None = None) -> Choice:
    """With the chunk at its bound, the stalled `step` is bounded by the sequences beside its
    prefills: the most sequences under which it (its decode rows fewer, their context in
    proportion) keeps the ITL target at the p99 of the fit's spread with the model's held-out
    error to spare; a hold when none down to its floor (`seqs_floor`) does, or when that is
    under `demand` (seqs_demand of the window: fewer would let the queue grow). Marked
    simulated: the controller spaces such fits out as it does replays."""
    target = spec.targets["itl_p99"]
    chunk, headroom = knobs.long_prefill_token_threshold, 1 + model.heldout_mape

    def wait(rows: int) -> float:
        context = step.decode_context_tokens * rows // max(1, step.decode_rows)
        return wait_at(model, replace(step, decode_rows=rows, decode_context_tokens=context), chunk, TAIL)

    rows = step.decode_rows
    while rows > 0 and wait(rows) * headroom > target:
        rows -= 1
    seqs, now, cut = rows + max(1, step.prefill_seqs), wait(step.decode_rows), wait(rows)
    prediction = {**prediction, "model_heldout_mape": model.heldout_mape, "decode_rows": step.decode_rows,
                  "predicted_wait_s": {str(step.decode_rows): now, str(rows): cut}}
    floor = seqs_floor(spec, knobs, raised)
    if rows == 0 or seqs < floor:
        return Choice(None, f"hold: {seen}; the chunk is at its bound and no max_num_seqs down to "
                            f"{floor} brings that step under the target", prediction, simulated=True)
    if seqs < demand:
        return Choice(None, f"hold: {seen}; the chunk is at its bound and max_num_seqs {seqs} would bring that step "
                            f"under the target, but fewer than {demand} (the sequences the window ran on average, "
                            "rounded up) would let the queue grow", prediction, simulated=True)
    move = bounded_move(knobs, spec, SEQS, seqs, f"{seen}; the chunk is at its bound, and the step-time model "
                        f"(held-out error {model.heldout_mape:.0%}) predicts {cut * 1000:.0f} ms with {rows} "
                        f"decode rows beside its prefill, {now * 1000:.0f} ms with {step.decode_rows} "
                        f"(p99 of its spread)")
    return Choice(move, move.reason, prediction, simulated=True) if move else Choice(
        None, f"hold: {seen}; the chunk is at its bound and max_num_seqs at or under {seqs}", prediction, simulated=True)


def prefills_cut(model: StepTimeModel, step: Composition, knobs: Knobs, spec: Spec, seen: str,
                 prediction: dict[str, Any], raised: Mapping[str, int] | None = None) -> Choice | None:
    """With the chunk at its bound, a stalled `step` that carried several prompts' chunks is
    bounded by their number (a prompt's last chunk and the next prompt's first ride together):
    the most prompts prefilled at once under which it keeps the ITL target at the p99 of the fit's
    spread with the model's held-out error to spare, or else the lower bound if it keeps the
    target at the median, as `deepest_needed` cuts the chunk (benchmarks/autopilot.py run 58: with
    64-token chunks, steps of two chunks beside ten decode rows were predicted at 300-320 ms at the
    median, one chunk at about 190). None: the step carried one prompt's chunk, the limit is at its
    floor (`prefills_floor`), or no limit down to there brings the step under the target even at
    the median."""
    target, chunk = spec.targets["itl_p99"], knobs.long_prefill_token_threshold
    now, floor = knobs.max_num_partial_prefills, prefills_floor(spec, knobs, raised)
    if min(now, step.prefill_seqs) <= floor:
        return None

    def wait(prompts: int, tail: float) -> float:
        fewer = replace(step, prefill_seqs=prompts, prefill_tokens=min(step.prefill_tokens, prompts * chunk))
        return wait_at(model, fewer, chunk, tail)

    headroom, cut = 1 + model.heldout_mape, min(now, step.prefill_seqs) - 1
    while cut > floor and wait(cut, TAIL) * headroom > target:
        cut -= 1
    before, p99, median = wait(step.prefill_seqs, TAIL), wait(cut, TAIL), wait(cut, MEDIAN)
    if p99 * headroom > target and median > target:
        return None
    move = bounded_move(knobs, spec, PREFILLS, cut, f"{seen}; the chunk is at its bound, and the step-time model "
                        f"(held-out error {model.heldout_mape:.0%}) predicts {p99 * 1000:.0f} ms with {cut} prompt(s) "
                        f"prefilled beside its decode rows ({median * 1000:.0f} ms at the median of its spread), "
                        f"{before * 1000:.0f} ms with {step.prefill_seqs} (p99 of its spread)")
    prediction = {**prediction, "model_heldout_mape": model.heldout_mape, "prefill_seqs": step.prefill_seqs,
                  "predicted_wait_s": {str(step.prefill_seqs): before, str(cut): p99}}
    return Choice(move, move.reason, prediction, simulated=True) if move else None


def budget_cut(model: StepTimeModel, step: Composition, knobs: Knobs, spec: Spec, fixed: Mapping[str, Any],
               seen: str, prediction: dict[str, Any], raised: Mapping[str, int] | None = None, *, why: str,
               simulated: bool) -> Choice | None:
    """A stalled `step` bounded by the token budget (`why` says why the budget: `step_bound`'s
    several prompts, or, with the chunk at its bound, more prompts than the limit on prompts
    prefilled at once: a prompt whose whole prefill fits one chunk finishes in its step and never
    counts toward that limit, so a run of short prompts fills the step up to the budget;
    benchmarks/autopilot.py run 88: with 64-token chunks and a 512-token budget, steps carrying 7
    prompts' prefill kept decode rows waiting up to 230 ms, and a cut of max_num_partial_prefills
    4→2 changed none of them; the best fixed setting's 256-token budget had no such stall). The
    largest budget, in whole KV blocks, under which the step (its prefill tokens within the budget
    less its decode rows, its prompts in proportion) keeps the ITL target at the p99 of the fit's
    spread with the model's held-out error to spare, or else the floor (`budget_floor`, with the
    chunk's own floor for the chunk: `floor_of`, which holds the long-prefill slots' floor) if it
    keeps the target at the median, as `deepest_needed` cuts the chunk; the chunk comes down with
    the budget where it would be over it. `simulated`: the controller spaces such fits out. None:
    the budget is at its floor, the step keeps the target under the budget in force, fits under
    the floor already (no cut makes it lighter), no budget down to the floor brings it under the
    target even at the median, or the move breaks a bound."""
    target, chunk = spec.targets["itl_p99"], knobs.long_prefill_token_threshold
    now, block = knobs.max_num_batched_tokens, kv_block(fixed)
    floor = budget_floor(spec, knobs, raised, chunk=min(chunk, floor_of(spec, fixed, knobs, raised)))

    def wait(budget: int, tail: float) -> float:
        tokens = min(step.prefill_tokens, max(0, budget - step.decode_rows))
        prompts = min(step.prefill_seqs, max(1, math.ceil(step.prefill_seqs * tokens / max(1, step.prefill_tokens))))
        return wait_at(model, replace(step, prefill_tokens=tokens, prefill_seqs=prompts), min(chunk, budget), tail)

    headroom = 1 + model.heldout_mape
    predicted = descend(now, floor, block, lambda b: wait(b, TAIL), target, headroom)
    budget = list(predicted)[-1]
    median = wait(budget, MEDIAN)
    if predicted[budget] >= predicted[now] or (predicted[budget] * headroom > target and median > target):
        return None  # no budget down to the floor makes that step lighter, or none brings it under the target
    forecast = f"{predicted[budget] * 1000:.0f} ms with a {budget}-token budget, {predicted[now] * 1000:.0f} ms " \
               f"with {now} (p99 of its spread)"
    if predicted[budget] * headroom > target:
        forecast += f"; {median * 1000:.0f} ms at its median: the deepest cut the bounds allow"
    move = bounded_moves(knobs, spec, {BUDGET: budget} | ({KNOB: budget} if budget < chunk else {}),
                         f"{seen}; {why}: the step-time model (held-out error {model.heldout_mape:.0%}) predicts "
                         f"{forecast}")
    prediction = {**prediction, "model_heldout_mape": model.heldout_mape, "prefill_seqs": step.prefill_seqs,
                  "predicted_wait_s": {str(b): t for b, t in predicted.items()}}
    return Choice(move, move.reason, prediction, simulated=simulated) if move else None


def budget_floor(spec: Spec, knobs: Knobs, raised: Mapping[str, int] | None = None, chunk: int | None = None) -> int:
    """The smallest token budget a cut goes to: the operator's lower bound, never under
    max_num_seqs (every running sequence's decode token fits) or one chunk (`chunk`: the least a
    cut may bring the chunk down to with it; default the chunk in force), and not under the
    budget now while the autopilot's raise of it is in force (`raised`, see `kept_raise`)."""
    return max(1, spec.bound(BUDGET)[0], knobs.max_num_seqs,
               knobs.long_prefill_token_threshold if chunk is None else chunk, kept_raise(knobs, BUDGET, raised))


def prefills_floor(spec: Spec, knobs: Knobs, raised: Mapping[str, int] | None = None) -> int:
    """The fewest prompts prefilled at once a cut goes to: the operator's lower bound, never under
    max_long_partial_prefills (the limit on long ones among them), and not under the limit now
    while the autopilot's raise of it is in force (`raised`, see `kept_raise`)."""
    return max(1, spec.bound(PREFILLS)[0], knobs.max_long_partial_prefills,
               kept_raise(knobs, PREFILLS, raised))


def seqs_floor(spec: Spec, knobs: Knobs, raised: Mapping[str, int] | None = None) -> int:
    """The smallest max_num_seqs a cut goes to: the operator's lower bound, and not under the
    limit now while the autopilot's raise of it is in force (`raised`, see `kept_raise`)."""
    return max(1, spec.bound(SEQS)[0], kept_raise(knobs, SEQS, raised))


def floor_of(spec: Spec, fixed: Mapping[str, Any], knobs: Knobs | None = None,
             raised: Mapping[str, int] | None = None) -> int:
    """The smallest chunk a cut goes to: the operator's lower bound, never under one KV block
    (smaller chunks pay a step's fixed cost for a sliver of a prompt), and never under a raise
    of the chunk in force (`kept_raise`: benchmarks/autopilot.py run 101, the chunk 64→96 for a
    TTFT p99 of 7.6 s and a stall cut back to 64 eleven seconds later)."""
    floor = max(spec.bound(KNOB)[0], kv_block(fixed))
    return floor if knobs is None else max(floor, kept_raise(knobs, KNOB, raised))


def kv_block(fixed: Mapping[str, Any]) -> int:
    """The engine's KV block size in tokens (1 when its fixed settings do not say)."""
    return max(1, int(fixed.get("block_size") or 1))


def fit_window(iterations: Sequence[IterationStats], fixed: Mapping[str, Any]) -> StepTimeModel:
    """The step-time model fitted on a window's iterations, keyed on the engine's fixed settings."""
    return fit_step_time([it.as_dict() for it in iterations], EngineKey.from_fixed(fixed))
