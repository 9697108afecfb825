"""The long-prefill slots: how low the chunk may go for the prompts the window brought.

A prompt is long while more than a chunk (long_prefill_token_threshold) of it is left to prefill:
it runs a chunk per step and holds one of max_long_partial_prefills slots for those steps; the
engine admits no other long prompt into the slot until only its last chunk is left, which runs in
the step that starts the next long prompt. A chunk cut therefore costs the long prompts capacity
twice: each holds its slot for more steps, and prompts that were short (prefilled in their step
beside any others) become long and queue for the slots. Cut below the length of the traffic's
prompts, the slots are busier than the arrivals allow and the queue grows for as long as the
traffic lasts (benchmarks/autopilot.py runs 103-105: chat prompts of 96-256 tokens at 6/s; a
stall cut or a foresight cut to 64 tokens, where every chat prompt is long, and TTFT p99 reached
6-8 s within a minute, 100 % of the queue held by max_long_partial_prefills; the raises of the
chunk that would drain it were barred as stalls, or came a step at a time).

`long_slots_floor` counts it from the window's own prompts (finished or in flight, arrived since
the window started; their uncached tokens): under a chunk of c tokens a prompt of n > c tokens
holds a slot for ceil(n / c) - 1 steps of a c-token chunk, and its last chunk adds what it costs
to the next one's first step (`slot_seconds`), each step as long as the step-time model fitted on
the window predicts beside the decode rows its prefill steps ran (until run 113 every chunk was
priced as a whole step of its own: run 113's first way read 106 % busy with 80-token chunks
where this count gives 80 % and the window's prefill steps took 81 % of its time, and the raises
that followed cost the chat phases their ITL). The floor is the smallest chunk, in whole KV
blocks, under which that is at most BUSY of the slots' time since the window started. No cut of
the chunk goes under it (`floored`), and a chunk under which the slots would be held longer than
the time there is (OVER) is raised to it at once (`slots_raise`), past the stall bar that holds
other raises until the queue starves (autopilot_stalls.raise_stalls): such slots are a queue that
grows for as long as the traffic lasts, and every request in it misses TTFT, whatever its
stream's gaps (run 106's second way: 112-token chunks with 900-1000-token prompts in the chat
traffic, the slots 153 % busy, and the raise to 208 barred until TTFT p99 reached twice its
target, 52 s after those prompts began).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from appliance.engine.knobs import Knobs
from appliance.records import InFlightRequest, IterationStats, RequestStats
from appliance.sim.fit import Composition, FitError, composition_of

from .autopilot_policy import MIN_REQUESTS, Choice, Spec, bounded_moves
from .autopilot_stalls import BUDGET, KNOB, PREFILLS, fit_window, kv_block

BUSY = 0.8  # the most of their time the long-prefill slots may be held by the window's prompts after a cut...
OVER = 1.0  # ...and past which a chunk under the floor is raised to it: the slots cannot keep up


@dataclass(frozen=True)
class SlotsFloor:
    """The chunk's floor for the window's prompts (0: too few prompts to say), and the slots'
    busy share under the chunk in force and under the floor."""

    chunk: int
    prompts: int = 0
    busy_now: float = 0.0
    busy_at_floor: float = 0.0
    longest: int = 0  # the longest prompt's uncached tokens: a floor past it is where no prompt is long


StepTime = Callable[[int, int], float]  # (prefill tokens, prompts prefilled) -> a step's seconds


def slot_seconds(n: int, chunk: int, step_s: StepTime) -> float:
    """How long a prompt of `n` uncached tokens holds a long-prefill slot with `chunk`-token
    chunks (0: it is never long): ceil(n / chunk) - 1 steps of a whole chunk, then what its last
    chunk adds to the step that starts the next long prompt (the engine counts a prompt as long
    while more than a chunk of it is left)."""
    if n <= chunk:
        return 0.0
    held = -(-n // chunk) - 1
    return held * step_s(chunk, 1) + step_s(chunk + n - held * chunk, 2) - step_s(chunk, 1)


def busy(prompts: Sequence[int], chunk: int, slots: int, step_s: StepTime, span_s: float) -> float:
    """The share of `slots` long-prefill slots' time over `span_s` that `prompts` (uncached
    tokens each) hold with `chunk`-token chunks (`slot_seconds`)."""
    return sum(slot_seconds(n, chunk, step_s) for n in prompts) / (max(1, slots) * span_s)


def long_slots_floor(iterations: Sequence[IterationStats], requests: Sequence[RequestStats],
                     in_flight: Sequence[InFlightRequest], knobs: Knobs, fixed: Mapping[str, Any],
                     now: float | None = None) -> SlotsFloor:
    """The smallest chunk, in whole KV blocks (`fixed`: the engine's settings, which also key the
    step-time model), under which the prompts that arrived since the window's first iteration
    (finished, or `in_flight` at `now`) keep the long-prefill slots busy at most BUSY of the time
    since then (`slot_seconds`), each step as long as the step-time model fitted on the window
    predicts beside the decode rows its prefill steps ran on average (a larger chunk takes fewer
    steps, each longer; when none shorter than the longest prompt does, the prefill work itself is
    more than the time holds, and the floor is the chunk under which no prompt is long). 0, no
    floor: fewer than MIN_REQUESTS such prompts, or a window the model cannot be fitted on."""
    if not iterations:
        return SlotsFloor(0)
    start = iterations[0].started_at
    end = now if now is not None else iterations[-1].started_at + iterations[-1].duration_s
    prompts = [r.prompt_tokens - r.cached_tokens for r in requests if r.arrival >= start]
    prompts += [r.prompt_tokens - r.cached_tokens for r in in_flight if r.arrival >= start]
    prefilling = [composition_of(it.as_dict()) for it in iterations if it.prefill_tokens > 0]
    if len(prompts) < MIN_REQUESTS or not prefilling or end <= start:
        return SlotsFloor(0, len(prompts))
    try:
        model = fit_window(iterations, fixed)
    except FitError:
        return SlotsFloor(0, len(prompts))
    rows = sum(c.decode_rows for c in prefilling) / len(prefilling)
    context = sum(c.decode_context_tokens for c in prefilling) / len(prefilling)
    slots, span_s = knobs.max_long_partial_prefills, end - start

    @functools.cache  # every chunk tried prices the same few compositions again (13 ms a call uncached, 4 cached)
    def step_s(tokens: int, seqs: int) -> float:
        return model.predict(Composition(round(rows), tokens, seqs, round(context))) + model.gap_s

    def share(chunk: int) -> float:
        return busy(prompts, chunk, slots, step_s, span_s)

    block = kv_block(fixed)
    floor = next(c for c in range(block, max(prompts) + block, block) if share(c) <= BUSY)  # none is long at the last
    return SlotsFloor(floor, len(prompts), share(knobs.long_prefill_token_threshold), share(floor), max(prompts))


def floored(spec: Spec, knobs: Knobs, floor: SlotsFloor) -> Spec:
    """`spec` with the chunk's lower bound raised to the slots' floor, or to the chunk in force
    when that is lower (no move of the chunk then goes under either; `slots_raise` lifts it); and,
    while the window's prompts hold the long slots at all, max_num_partial_prefills' lower bound
    one over max_long_partial_prefills (or the value in force, if lower): at that limit, whenever
    the long slots are all taken, the engine admits no prompt at all, however short (the limit
    counts every prompt still prefilling, and the long ones fill it)."""
    bounds = dict(spec.bounds)
    lo, hi = spec.bound(KNOB)
    bounds[KNOB] = (max(lo, min(floor.chunk, knobs.long_prefill_token_threshold, hi)), hi)
    if floor.busy_now > 0:
        lo, hi = spec.bound(PREFILLS)
        room = min(knobs.max_long_partial_prefills + 1, knobs.max_num_partial_prefills, hi)
        bounds[PREFILLS] = (max(lo, room), hi)
    changed = {name: b for name, b in bounds.items() if spec.bound(name) != b}
    return replace(spec, bounds={**spec.bounds, **changed}) if changed else spec


def slots_raise(knobs: Knobs, spec: Spec, floor: SlotsFloor) -> Choice | None:
    """The raise of a chunk under which the slots are busier than OVER to the floor (within the
    operator's bounds, the token budget's too), the budget brought up with it where it was under
    (the chunk may not pass it), or None; none when the floor is where no prompt is long (the
    prefill work itself is more than the time holds: a larger chunk saves steps' fixed costs, not
    the queue)."""
    chunk = knobs.long_prefill_token_threshold
    if floor.chunk <= chunk or floor.busy_now <= OVER or floor.chunk >= floor.longest:
        return None
    why = (f"the window's {floor.prompts} prompts would keep max_long_partial_prefills "
           f"({knobs.max_long_partial_prefills}) busy {floor.busy_now:.0%} of the time with {chunk}-token chunks "
           f"(a prompt holds a slot while more than a chunk of it is left), "
           f"{floor.busy_at_floor:.0%} with {floor.chunk} (at most {BUSY:.0%})")
    lo, hi = spec.bound(KNOB)
    wanted = min(max(lo, min(hi, floor.chunk)), spec.bound(BUDGET)[1])
    budget = max(knobs.max_num_batched_tokens, wanted)  # the chunk may not pass it
    move = bounded_moves(knobs, spec, {KNOB: wanted, BUDGET: budget}, why)
    if move is None or move.changes.get(KNOB, chunk) <= chunk:
        return None
    return Choice(move, move.reason, {"long_slots_busy": {str(chunk): floor.busy_now,
                                                          str(floor.chunk): floor.busy_at_floor}})
