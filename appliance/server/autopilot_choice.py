"""The autopilot's choice by simulation: the rules propose candidate moves (each inside the
operator's bounds); the what-if simulator, fitted on the window's own iterations, replays the
window's finished requests and the engine's requests still in flight under the knobs in force
and under each candidate; the candidate with the best predicted SLO attainment is chosen only if
it beats the knobs in force by a margin (hysteresis); a chosen cut of max_num_seqs must also
hold against the knobs in force with the window's requests arriving twice as fast
(`load_checked`). Too few iterations to fit, or a replay of the knobs in force that misses the
attainment measured on the requests whose outcome is known (finished, or in flight and missed
already) by more than CALIBRATION: the rules alone decide (the reason says so). A replay that
cannot run: hold.

First the long-prefill slots (autopilot_slots): a chunk under which the window's prompts would
hold them longer than there is time is raised, and no move of the chunk goes under their floor.

Before any replay (`without_replay`, milliseconds: a step-time fit at most): too few finished
requests to replay, a prefill stall the iterations show, or one the step-time model foresees
from a whole chunk beside the decode rows in flight, cuts the chunk (autopilot_stalls), else
hold; with enough of them and TTFT p99 within its target, such a stall cuts the chunk as well, at
once (a replay takes seconds, and knows the streams in flight only by the outputs it estimates);
no candidate move: hold. A raise of the prompts prefilled at once, the chunk or the budget, that the
step-time model foresees stalling decode rows past the ITL target is barred
(autopilot_stalls.raise_stalls), from the replayed candidates and from the rules' move alike. A
replay that ends in a hold leaves the choice to the stall answer when the window's prefill steps
stalled (`or_stall_cut`).
Replays (`replayed`) are bounded (at most MAX_REQUESTS requests, autopilot_requests; a time
budget checked between replays, the load check's two excepted; a candidate that only lowers a
limit the replay of the knobs in force never came up to is not replayed: its forecast is that
replay's) and run where the caller runs them (in the server: a worker process at nice 19, `autopilot_worker`,
whose CPU the engine's threads share; never the engine's thread).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from appliance.bench.metrics import SLO, RequestResult
from appliance.engine.knobs import Knobs
from appliance.records import COMPLETED_REASONS, HoldCause, InFlightRequest, IterationStats, RequestStats
from appliance.sim.fit import MIN_ROWS, FitError
from appliance.sim.replay import CacheShape, ReplayError, ReplayResult, SimRequest, replay

from .autopilot_policy import (MIN_REQUESTS, Choice, DecodeGaps, Move, Spec, WindowStats, bounded_move, decide, p99,
                               relaxed, undoes_raise, window_stats)
from .autopilot_requests import ReplaySet, missed_already, replayable
from .autopilot_slots import floored, long_slots_floor, slots_raise
from .autopilot_stalls import KNOB as CHUNK, chunk_cut, fit_window, raise_stalls, starves

MARGIN = 0.05  # a candidate must raise the predicted attainment by this share of requests...
P99_MARGIN = 0.2  # ...or, at no loss of attainment, cut the worst target's predicted p99 by this share
TIE = 0.02  # candidates predicted within this share of requests of the best one count as equally good
MAX_CANDIDATES = 6
BUDGET_S = 5.0  # no replay starts after this long
# the replay of the knobs in force must land within this share of requests of the measured
# attainment; else the window does not explain its own latency (load from before it, requests
# still in flight, a machine whose speed moved) and the rules decide alone
CALIBRATION = 0.25
# a cut of max_num_seqs the replays chose must also hold with the window's requests arriving this
# many times as fast: the window shows the load that was, not the next one (benchmarks/autopilot.py
# runs 45-50: eleven cuts to 8 made at light load, each outgrown when the long prompts came; in run
# 50 this check passed both, twice the chat rate being served by 8, and since run 51 such cuts are
# only tried where decode-only steps stall: WindowStats.decode_rows_stall)
LOAD_GROWTH = 2.0
# the raises tried for the limit that held queued requests (the rules' own step comes first)
RAISES: dict[HoldCause, Callable[[int], list[int]]] = {
    HoldCause.MAX_NUM_SEQS: lambda v: [math.ceil(v * 1.5), v * 2],
    HoldCause.TOKEN_BUDGET: lambda v: [math.ceil(v * 1.5), v * 2],
    HoldCause.PARTIAL_PREFILLS: lambda v: [v + 1],
    HoldCause.LONG_PARTIAL_PREFILLS: lambda v: [v + 1],
}
# the limits on prompts prefilled at once hold a queue for as many steps as the prompts in
# progress take to prefill: a larger chunk drains each of them in fewer steps (and fewer prompts
# count as long); what it costs the streams the stall bar and the replay price, as for one more
# prompt at once (benchmarks/autopilot.py run 96: with 80-token chunks, max_long_partial_prefills
# 1→2 for a TTFT p99 of 4.2 s, and 270 misses in the long prompts' phase where the way with
# 112-token chunks had none)
DRAINED_BY_CHUNK = (HoldCause.PARTIAL_PREFILLS, HoldCause.LONG_PARTIAL_PREFILLS)


@dataclass(frozen=True)
class Forecast:
    """One replay's SLO figures: share of requests within the targets, and the p99s over requests
    (of TTFT, and of each request's longest inter-token gap, as the window's)."""

    attainment: float
    ttft_p99: float | None
    itl_p99: float | None

    def worst_ratio(self, spec: Spec) -> float:
        """The largest predicted p99 / target over the targets (above 1: a target missed)."""
        pairs = ((self.ttft_p99, spec.targets.get("ttft_p99")), (self.itl_p99, spec.targets.get("itl_p99")))
        return max((v / t for v, t in pairs if v is not None and t), default=0.0)

    def keeps(self, spec: Spec, headroom: float = 0.0) -> bool:
        """Every target predicted kept, with `headroom` (a share of each target) to spare."""
        return self.worst_ratio(spec) * (1 + headroom) <= 1

    def text(self) -> str:
        ms = lambda v: "-" if v is None else f"{v * 1000:.0f} ms"  # noqa: E731
        return f"attainment {self.attainment:.0%}, TTFT p99 {ms(self.ttft_p99)}, ITL p99 {ms(self.itl_p99)}"


def over_targets(w: WindowStats, spec: Spec) -> tuple[bool, bool]:
    """(TTFT p99 over its target, ITL p99 over its target) in the measured window."""
    def over(value: float | None, name: str) -> bool:
        return value is not None and name in spec.targets and value > spec.targets[name]

    return over(w.ttft_p99, "ttft_p99"), over(w.itl_p99, "itl_p99")


def candidates(w: WindowStats, knobs: Knobs, spec: Spec, last_raise: Mapping[str, int] | None = None,
               raised: Mapping[str, int] | None = None) -> list[Move]:
    """The moves worth simulating, the rules' own first, each inside the bounds and valid as a
    whole set; at most MAX_CANDIDATES. Unlike the rules alone, an ITL over target also tries
    halving the token budget and the concurrent partial prefills (with several prompts prefilling
    at once, those, not the chunk, bound a step's size), the chunk at a quarter (a stall
    several times the target needs more than one halving), and a raise of max_num_seqs is tried
    even with the KV cache nearly full (the replay shows whether preemptions eat the gain). A
    lower max_num_seqs is tried, as by the rules, only when the steps without prefill stall the
    decode rows themselves (`WindowStats.decode_rows_stall`). A TTFT over target that a limit on
    the prompts prefilled at once held also tries the chunk at 1.5x and 2x (`DRAINED_BY_CHUNK`).
    None lowers a knob the autopilot's raise in force raised (`raised`; `undoes_raise`), but the
    relax rule's own move."""
    rule = decide(w, knobs, spec, dict(last_raise or {}))
    out = [rule] if rule is not None and (relaxed(w, spec) or not undoes_raise(rule, knobs, raised)) else []
    ttft_over, itl_over = over_targets(w, spec)
    k = knobs.as_dict()
    if ttft_over:
        total = sum(w.held_s.values())
        for cause in sorted((c for c in RAISES if w.held_s[c] > 0), key=lambda c: -w.held_s[c]):
            why = f"TTFT p99 {w.ttft_p99:.3f} s over target; {w.held_s[cause] / total:.0%} of queueing held by {cause}"
            out += [m for v in RAISES[cause](k[cause.value]) if (m := bounded_move(knobs, spec, cause.value, v, why))]
            if cause in DRAINED_BY_CHUNK:
                drain = f"{why}: a larger chunk prefills each held prompt in fewer steps"
                out += [m for v in (math.ceil(k[CHUNK] * 1.5), k[CHUNK] * 2)
                        if (m := bounded_move(knobs, spec, CHUNK, v, drain))]
    if itl_over:
        why = f"ITL p99 {(w.itl_p99 or 0) * 1000:.0f} ms over target"
        chunk = k[CHUNK]
        for name, value in ((CHUNK, max(1, chunk // 2)),
                            ("max_num_batched_tokens", max(1, k["max_num_batched_tokens"] // 2)),
                            ("max_num_partial_prefills", max(1, k["max_num_partial_prefills"] // 2)),
                            (CHUNK, max(1, chunk // 4)),
                            ("max_num_seqs", w.fewer_seqs(k["max_num_seqs"]))):
            if name == "max_num_seqs" and not w.decode_rows_stall(spec.targets["itl_p99"]):
                continue
            if (m := bounded_move(knobs, spec, name, value, why)) is not None:
                out.append(m)
    unique: dict[tuple[tuple[str, int], ...], Move] = {}
    for m in out:
        if m is rule or not undoes_raise(m, knobs, raised):
            unique.setdefault(_key(m), m)
    return list(unique.values())[:MAX_CANDIDATES]


def nothing_helps(w: WindowStats) -> str:
    """Why no candidate exists although a target is missed."""
    total = sum(w.held_s.values())
    if total <= 0:
        return "a target is missed but no limit held queued requests (the time is compute, not queueing)"
    if max(w.held_s, key=lambda c: w.held_s[c]) is HoldCause.KV_BLOCKS:
        return "queueing was held mostly by free KV blocks: no knob here adds memory"
    return "every knob that could help is at its bound"


def measured_attainment(done: Sequence[RequestStats], slo: SLO, gaps: DecodeGaps, missed: int = 0) -> float:
    """The share of `done` and `missed` more requests (in flight, missed already) that met `slo`
    as the server measured them (from arrival; each request's inter-token gaps from the
    iterations it streamed through)."""
    met = sum(slo.met_by(RequestResult(
        index=i, sent_at=r.arrival, ok=r.finish_reason in COMPLETED_REASONS, output_tokens=r.output_tokens,
        ttft=None if r.first_token is None else r.first_token - r.arrival, e2e=r.finished - r.arrival,
        itl=[] if r.first_token is None else gaps.of_request(r.first_token, r.finished)))
        for i, r in enumerate(done))
    return met / max(1, len(done) + missed)


def without_replay(iterations: Sequence[IterationStats], requests: Sequence[RequestStats], knobs: Knobs, spec: Spec,
                   fixed: Mapping[str, Any], last_raise: Mapping[str, int] | None = None,
                   kept: Sequence[IterationStats] = (), raised: Mapping[str, int] | None = None,
                   in_flight: Sequence[InFlightRequest] = (), now: float | None = None) -> Choice | None:
    """The choice that needs no replay (milliseconds: a step-time fit at most), or None when
    the window's replay decides: too few finished requests (a stall, seen or foreseen, cuts the
    chunk, else hold; `kept`: the engine's steps from before the window, which price a chunk the
    window has not yet); with TTFT p99 within its target, a prefill stall the chunk explains cuts
    it, at once (a replay takes seconds, and knows the streams in flight only by estimated outputs);
    no candidate move (hold). `raised`: the autopilot's last raise in force ({knob: its value
    before}), which no stall cut undoes (autopilot_policy.kept_raise); `in_flight`: the requests
    not finished at `now` (window_stats)."""
    w = window_stats(iterations, requests, in_flight=in_flight, now=now)
    if w.requests < MIN_REQUESTS:
        return chunk_cut(iterations, knobs, spec, fixed, kept=kept, raised=raised, in_flight=len(in_flight)) or Choice(
            None, f"hold: {w.requests} finished request(s) in the window, at least {MIN_REQUESTS} needed")
    ttft_target = spec.targets.get("ttft_p99")
    ttft_kept = ttft_target is None or w.ttft_p99 is None or w.ttft_p99 <= ttft_target
    if ttft_kept:  # the rules' order: TTFT first
        cut = chunk_cut(iterations, knobs, spec, fixed, foresee=False, raised=raised)
        if cut is not None and cut.move is not None:
            return cut
    if not candidates(w, knobs, spec, last_raise, raised):
        hold = Choice(None, "hold: " + (nothing_helps(w) if any(over_targets(w, spec)) else "targets met"))
        return hold if ttft_kept else or_stall_cut(hold, iterations, knobs, spec, fixed, raised)
    return None


def choose(iterations: Sequence[IterationStats], requests: Sequence[RequestStats], knobs: Knobs, spec: Spec,
           fixed: Mapping[str, Any], last_raise: Mapping[str, int], kept: Sequence[IterationStats],
           raised: Mapping[str, int], operator: Mapping[str, Any], in_flight: Sequence[InFlightRequest],
           now: float, *, budget_s: float = BUDGET_S, run: Callable[..., Choice] | None = None) -> Choice:
    """The simulating autopilot's decision: a chunk under which the long-prefill slots cannot
    keep up with the window's prompts raised (autopilot_slots; no move of the chunk goes under
    their floor), else `without_replay` where it decides (in the caller's
    thread: a worker at nice 19 beside a busy engine would wait most of a second for the CPU,
    benchmarks/autopilot.py run 22, where the foreseen cut came just after the first stall), else
    `replayed`, through `run` (the server's: its worker process; default: here). The arguments
    are `without_replay`'s and `replayed`'s."""
    slots = long_slots_floor(iterations, requests, in_flight, knobs, fixed, now)
    if (up := slots_raise(knobs, spec, slots)) is not None:
        return up
    spec = floored(spec, knobs, slots)
    quick = without_replay(iterations, requests, knobs, spec, fixed, last_raise, kept, raised, in_flight, now)
    if quick is not None:
        return quick
    return (run or replayed)(iterations, requests, knobs, spec, fixed, last_raise, budget_s=budget_s, raised=raised,
                             operator=operator, in_flight=in_flight, now=now)


def replayed(iterations: Sequence[IterationStats], requests: Sequence[RequestStats], knobs: Knobs, spec: Spec,
             fixed: Mapping[str, Any], last_raise: Mapping[str, int] | None = None, *, budget_s: float = BUDGET_S,
             raised: Mapping[str, int] | None = None, operator: Mapping[str, Any] | None = None,
             in_flight: Sequence[InFlightRequest] = (), now: float | None = None,
             clock: Callable[[], float] = time.perf_counter) -> Choice:
    """The choice by replaying the window under the knobs in force and each candidate (for a
    window `without_replay` left undecided; seconds of pure Python: the server runs it in the
    autopilot's worker). `fixed`: GET /admin/knobs' fixed settings (the cache shape and the
    engine the step-time model is keyed on); `raised`: as `without_replay`'s; `operator`: the
    operator's knob values, up to which a starving queue lifts the stall bar on raises
    (autopilot_stalls.raise_stalls); `in_flight`: the requests not finished at `now`, replayed
    beside the finished ones (the backlog a replay of finished requests alone cannot see: runs
    96-99's second ways, whose replays of the knobs in force predicted 67-100 % within the
    targets while a queue of long prompts missed every one). The replay of the knobs in force is
    checked against what was measured on the requests whose outcome is known: the finished ones
    and those in flight that missed already (`missed_already`)."""
    gaps = DecodeGaps.of(iterations)
    w = window_stats(iterations, requests, gaps, in_flight, now)
    moves = candidates(w, knobs, spec, last_raise, raised)
    rule = decide(w, knobs, spec, dict(last_raise or {}))
    if rule is not None and _key(rule) not in {_key(m) for m in moves}:  # it undoes the raise in force
        rule = None
    try:
        model = fit_window(iterations, fixed)
    except FitError as exc:
        return rules_only(rule, f"{exc} in the window (the simulator needs {MIN_ROWS})")
    barred = {_key(m): why for m in moves
              if (why := raise_stalls(model, iterations, requests, knobs, spec, m, w.ttft_p99, operator))}
    if rule is not None and _key(rule) in barred:  # the rules' move is the first candidate
        rule = None
    moves = [m for m in moves if _key(m) not in barred]
    if not moves:
        return or_stall_cut(Choice(None, "hold: " + "; ".join(barred.values())), iterations, knobs, spec, fixed,
                            raised)
    cache = CacheShape(int(fixed["num_blocks"]), int(fixed["block_size"]), int(fixed["max_model_len"]))
    slo = SLO(ttft=spec.targets.get("ttft_p99"), itl=spec.targets.get("itl_p99"))
    done, pending, start = replayable(requests, in_flight, start=min(it.started_at for it in iterations))
    carried = ReplaySet.of(done, pending, start=start, now=now)
    missed = [len(done) + i for i, r in enumerate(pending) if now is not None and missed_already(r, now, slo, gaps)]
    known = [*range(len(done)), *missed]  # the requests whose outcome was measured
    measured = measured_attainment(done, slo, gaps, len(missed))
    started = clock()

    def forecast(k: Knobs, arriving: Sequence[SimRequest] = carried.requests) -> tuple[Forecast, ReplayResult]:
        out = replay(arriving, k, cache, model, slo=slo)
        s = out.summary
        return Forecast((s.slo_met or 0) / max(1, s.num_requests), s.ttft.p99,
                        p99([max(r.itl) for r in out.results if r.ok and r.itl])), out

    try:
        base, out = forecast(knobs)
        steps = out.iterations
        results = carried.results(out.results)  # each TTFT from the request's own arrival
        checked = sum(slo.met_by(results[i]) for i in known) / max(1, len(known))
        if abs(checked - measured) > CALIBRATION:  # the window does not explain what was measured
            alone = rules_only(rule, f"the replay of the knobs in force predicts {checked:.0%} "
                                     f"within the targets, {measured:.0%} was measured")
            return replace(or_stall_cut(alone, iterations, knobs, spec, fixed, raised), simulated=True)
        tried: list[tuple[Move, Forecast]] = []
        unreached: list[dict[str, int]] = []
        for m in moves:
            if never_reached(m, knobs, steps):  # its replay would be the base's, step for step: not run
                tried.append((m, base))
                unreached.append(m.changes)
                continue
            if clock() - started > budget_s:
                break
            tried.append((m, forecast(knobs.with_changes(m.changes))[0]))
    except ReplayError as exc:
        return Choice(None, f"hold: the simulation failed ({exc})", simulated=True)
    prediction: dict[str, Any] = {
        "measured_attainment": measured, "before": asdict(base), "requests": len(carried.requests),
        "in_flight": len(pending), "missed_in_flight": len(missed),
        "model_heldout_mape": model.heldout_mape,
        "candidates": [{"changes": m.changes, **asdict(f)} for m, f in tried],
        "never_reached": unreached, "skipped": [m.changes for m in moves[len(tried):]],
        "barred": list(barred.values())}
    if not tried:
        return Choice(None, f"hold: the time budget ({budget_s:g} s) ran out before any candidate", prediction, True)
    choice = weigh(w, spec, base, tried, prediction, headroom=model.heldout_mape)
    if choice.move is not None and choice.move.changes.get("max_num_seqs", knobs.max_num_seqs) < knobs.max_num_seqs:
        busier = heavier(carried.requests, LOAD_GROWTH)
        try:
            choice = load_checked(choice, knobs, lambda k: forecast(k, busier)[0])
        except ReplayError as exc:
            return Choice(None, f"hold: the simulation failed ({exc})", prediction, True)
    priced = {_key(m): f for m, f in tried}
    try:
        return replace(stall_answer(choice, or_stall_cut(choice, iterations, knobs, spec, fixed, raised), w, spec, base,
                                    lambda m: priced.get(_key(m)) or forecast(knobs.with_changes(m.changes))[0],
                                    prediction, model.heldout_mape), simulated=True)
    except ReplayError as exc:
        return Choice(None, f"hold: the simulation failed ({exc})", prediction, True)


def stall_answer(hold: Choice, stall: Choice, w: WindowStats, spec: Spec, base: Forecast,
                 price: Callable[[Move], Forecast], prediction: dict[str, Any], headroom: float = 0.0) -> Choice:
    """`stall` (`or_stall_cut`'s answer to the replays' `hold`), priced like a candidate when a
    target is missed: a move whose replay (`price`) pushes a target's p99 past it (`pushed_past`,
    with `headroom`) is not made, and the hold says so (benchmarks/autopilot.py
    run 100: `max_num_partial_prefills` 4→2 for a 194 ms stall with TTFT p99 at 4.7 s; replayed
    from that run's store afterwards, TTFT p99 4.4 → 6.1 s; the long prompts' phase then missed
    312 requests)."""
    if hold.move is not None or stall.move is None or not any(over_targets(w, spec)):
        return stall
    after = price(stall.move)
    why = pushed_past(base, after, spec, starves(w.ttft_p99, spec), headroom)
    if why is None:
        return stall
    prediction["stall_answer"] = {"changes": stall.move.changes, **asdict(after)}
    return Choice(None, f"{hold.reason} [the prefill stalls' answer ({_label(stall.move)}) is not made: its replay "
                        f"pushes {why}]", prediction)


def heavier(reqs: Sequence[SimRequest], factor: float) -> list[SimRequest]:
    """The same requests arriving `factor` times as fast (arrivals and cancellations compressed)."""
    return [replace(r, arrival=r.arrival / factor, cancel_at=None if r.cancel_at is None else r.cancel_at / factor)
            for r in reqs]


def load_checked(choice: Choice, knobs: Knobs, forecast: Callable[[Knobs], Forecast]) -> Choice:
    """`choice` (a cut of max_num_seqs), or a hold when, with the window's requests arriving
    LOAD_GROWTH times as fast (`forecast`: a replay of those), the cut is predicted to keep MARGIN
    fewer of them within the targets than the knobs in force: a limit the next load outgrows
    queues it for as long as it lasts. The two forecasts join the choice's prediction."""
    assert choice.move is not None
    before, after = forecast(knobs), forecast(knobs.with_changes(choice.move.changes))
    if choice.prediction is not None:
        choice.prediction["load_check"] = {"growth": LOAD_GROWTH, "before": asdict(before), "after": asdict(after)}
    if after.attainment >= before.attainment - MARGIN:
        return choice
    now = knobs.as_dict()
    cut = ", ".join(f"{name} {now[name]}→{value}" for name, value in choice.move.changes.items())
    return Choice(None, f"hold: {cut} barred: with the window's requests arriving {LOAD_GROWTH:g}x "
                        f"as fast the replay predicts {after.attainment:.0%} of them within the targets against "
                        f"{before.attainment:.0%} with the knobs in force (a cut the next load would outgrow)",
                  choice.prediction)


def or_stall_cut(choice: Choice, iterations: Sequence[IterationStats], knobs: Knobs, spec: Spec,
                 fixed: Mapping[str, Any], raised: Mapping[str, int] | None = None) -> Choice:
    """`choice`, or, when it holds, the answer to the window's prefill stalls (`chunk_cut`: the
    chunk, or with the chunk at its bound the prompts prefilled at once or max_num_seqs): the
    replay's figures for the streams those stalls keep waiting rest on estimated outputs, and
    replays of finished requests alone missed them (benchmarks/autopilot.py runs 37-38: replays
    that never ran more than 8 sequences predicted max_num_seqs 8 to change nothing while the
    live batch ran up to 16 beside 64-token chunks). When that answer holds too, its reason joins
    the hold's: the decision says why neither acted."""
    if choice.move is not None:
        return choice
    cut = chunk_cut(iterations, knobs, spec, fixed, foresee=False, raised=raised)
    if cut is None:
        return choice
    if cut.move is None:
        return replace(choice, reason=f"{choice.reason} [the prefill stalls: {cut.reason.removeprefix('hold: ')}]")
    return Choice(cut.move, f"{cut.reason} [the replays held: {choice.reason.removeprefix('hold: ')}]",
                  cut.prediction, simulated=True)


# limits whose lowering changes nothing when the replay never reached the lower value: knob ->
# the most a step of the replay used of it (running after admission: those still running plus
# those the step finished; tokens it scheduled, strictly under the new budget; prefills in it).
# The chunk is not among them: it also decides which prompts count as long.
USED: dict[str, Callable[[IterationStats], int]] = {
    "max_num_seqs": lambda it: it.running + it.finished,
    "max_num_batched_tokens": lambda it: it.scheduled_tokens + 1,
    "max_num_partial_prefills": lambda it: it.prefill_seqs,
}


def never_reached(move: Move, knobs: Knobs, steps: Sequence[IterationStats]) -> bool:
    """Whether `move` only lowers limits (from `knobs`) that no step of their replay came up to
    (then its own replay schedules every step the same: same forecast, no need to run it)."""
    now = knobs.as_dict()
    return all(name in USED and value < now[name] and max((USED[name](it) for it in steps), default=0) <= value
               for name, value in move.changes.items())


def rules_only(rule: Move | None, why: str) -> Choice:
    """The rules' move when the simulator cannot be used (`why`), or a hold when they have none."""
    if rule is None:
        return Choice(None, f"hold: the rules propose nothing and the simulator is not used ({why})")
    return Choice(rule, f"{rule.reason} [rules only: {why}]")


def weigh(w: WindowStats, spec: Spec, base: Forecast, tried: Sequence[tuple[Move, Forecast]],
          prediction: dict[str, Any], headroom: float = 0.0) -> Choice:
    """The best candidate (`pick`, with `headroom`) if it beats the knobs in force by the margin
    (a give-back: if it loses nothing and keeps the targets with `headroom` to spare), else hold.
    For a target missed, candidates that push a target's p99 past it (`pushed_past`; once the
    queue starves, TTFT's only) are not weighed."""
    over = any(over_targets(w, spec))
    if over:
        starving = starves(w.ttft_p99, spec)
        pushed = {_key(m): why for m, f in tried if (why := pushed_past(base, f, spec, starving, headroom))}
        prediction["pushed_past"] = [f"{_label(m)}: {pushed[_key(m)]}" for m, _ in tried if _key(m) in pushed]
        if len(pushed) == len(tried):
            why = "; ".join(prediction["pushed_past"])
            return Choice(None, f"hold: every candidate pushes a target's p99 past it ({why})", prediction)
        tried = [(m, f) for m, f in tried if _key(m) not in pushed]
    best, after = pick(tried, spec, headroom)
    if not over:  # the rules give a raise back
        wins = after.attainment >= base.attainment and after.keeps(spec, headroom)
    else:
        wins = (after.attainment >= base.attainment + MARGIN
                or (after.attainment >= base.attainment
                    and after.worst_ratio(spec) <= (1 - P99_MARGIN) * base.worst_ratio(spec)))
    prediction["after"] = asdict(after)
    verdict = f"predicted {base.text()} → {after.text()}"
    if not wins:
        return Choice(None, f"hold: the best candidate ({_label(best)}) is not better enough: {verdict}", prediction)
    return Choice(best, f"{best.reason}; {verdict}", prediction)


def pushed_past(base: Forecast, after: Forecast, spec: Spec, starving: bool = False,
                headroom: float = 0.0) -> str | None:
    """How `after` pays for its gain with a target's tail, or None: the p99 it predicts for a target
    is past that target and more than P99_MARGIN over the knobs in force's (`base`). The streams
    in flight pay such a cost on outputs the replay can only estimate (benchmarks/autopilot.py
    run 96: max_long_partial_prefills 1→2 for TTFT, replayed at 77 → 88 % within the targets with
    ITL p99 162 → 279 ms; the next window's replay of it predicted 15 %, and the long prompts'
    phase missed 270 requests where the way that made no such raise missed none). Once the queue
    starves (`starving`) only TTFT counts, and any rise past the step-time model's error
    (`headroom`): the replay ends with the window's arrivals, the queue goes on growing after it
    (run 101: max_num_partial_prefills 4→2 for ITL at a TTFT p99 of 16 s, replayed at 8 → 16 %
    within the targets and TTFT p99 16.5 → 19.8 s; TTFT p99 was 20 s through the next phase)."""
    checks = ((("ttft_p99", base.ttft_p99, after.ttft_p99),) if starving else
              (("ttft_p99", base.ttft_p99, after.ttft_p99), ("itl_p99", base.itl_p99, after.itl_p99)))
    margin = headroom if starving else P99_MARGIN
    for name, before, now in checks:
        target = spec.targets.get(name)
        if target and now is not None and now > target and (before is None or now > (1 + margin) * before):
            was = "-" if before is None else f"{before * 1000:.0f}"
            label = name.removesuffix("_p99").upper()
            return f"{label} p99 {was} → {now * 1000:.0f} ms (target {target * 1000:.0f} ms)"
    return None


def pick(tried: Sequence[tuple[Move, Forecast]], spec: Spec, headroom: float = 0.0) -> tuple[Move, Forecast]:
    """The first move among those predicted within TIE of the best attainment that keeps every
    target with `headroom` to spare (candidates come the rules' own step first, then each knob's
    steps smallest first), else the one of those nearest its targets. A bigger step than needed
    buys nothing the window shows and may cost what it does not: a chunk cut deeper than the ITL
    target needs slows the long prompts that come next. The headroom is the step-time model's
    held-out error: a p99 predicted just under its target by less than the model's own error is
    not counted as kept (a step that falls short costs a round of cooldown before the next)."""
    top = max(f.attainment for _, f in tried)
    near = [(m, f) for m, f in tried if f.attainment >= top - TIE]
    keeping = [(m, f) for m, f in near if f.keeps(spec, headroom)]
    return keeping[0] if keeping else min(near, key=lambda mf: mf[1].worst_ratio(spec))


def _key(m: Move) -> tuple[tuple[str, int], ...]:
    """A move's changes, as a key: two moves that change the same knobs to the same values are one."""
    return tuple(sorted(m.changes.items()))


def _label(m: Move) -> str:
    return ", ".join(f"{k}={v}" for k, v in m.changes.items())
