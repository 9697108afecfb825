"""The SLO autopilot's rules: its spec (targets and knob bounds), the recent window it reads,
and the one move it chooses. Pure functions, no I/O and no clock.

Rules driven by the binding-cause counters (appliance.records.HoldCause); they propose the
moves the simulator weighs (autopilot_choice) and decide alone when the window is too small to
fit it. Rules, in order:
- TTFT p99 over its target: raise the knob of the limit that held most of the queued
  request-time (max_num_seqs only while KV usage peaks under KV_ROOM; nothing when free KV blocks
  held it: no knob here adds memory).
- else ITL p99 over its target: halve long_prefill_token_threshold when steps carried prefill
  chunks (smaller chunks bound the stall); else, when the steps that carried no chunk kept their
  decode rows past the target themselves (their waits' p99), lower max_num_seqs (below the most
  that ran, never under the mean that ran: `seqs_demand`). Stalls that only the chunk steps
  make are not the decode rows' doing: whether fewer rows beside a chunk bring such a step under
  the target is the step-time model's call (autopilot_stalls).
- else both under RELAX x target: give back the most recent raise, one step at a time.
Each move stays inside the operator's bounds and is checked as a whole knob set.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.engine.knobs import KnobError, Knobs, field_errors
from appliance.numeric import percentile
from appliance.records import HoldCause, InFlightRequest, IterationStats, RequestStats

TARGETS = ("ttft_p99", "itl_p99")
TUNABLE = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
           "max_num_partial_prefills", "max_long_partial_prefills")
KV_ROOM = 0.8
RELAX = 0.5  # both percentiles under this share of their targets: relax the last raise
MIN_REQUESTS = 5  # fewer finished requests in the window: no decision
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")
_RANGE = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")


class SpecError(ValueError):
    """A bad autopilot spec; `errors` maps each bad entry to a message."""

    def __init__(self, errors: Mapping[str, str]):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{k}: {v}" for k, v in self.errors.items()))


@dataclass(frozen=True)
class Spec:
    """Targets (seconds) and inclusive knob bounds."""

    targets: dict[str, float]
    bounds: dict[str, tuple[int, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"targets": dict(self.targets), "bounds": {k: list(v) for k, v in self.bounds.items()}}

    def bound(self, name: str) -> tuple[int, int]:
        """The operator's (lower, upper) bound on knob `name`; (1, 2**30) where none is set."""
        return self.bounds.get(name, (1, 1 << 30))


def parse_spec(text: str | Mapping[str, Any]) -> Spec:
    """"ttft_p99=1s,itl_p99=150ms,max_num_seqs=8..128" (or the same as a mapping with
    "targets" / "bounds"). Raises SpecError naming every bad entry."""
    if isinstance(text, Mapping):
        errors = {str(k): "unknown field (use targets and bounds)" for k in set(text) - {"targets", "bounds"}}
        parts = {}
        for name in ("targets", "bounds"):
            part = text.get(name) or {}
            if isinstance(part, Mapping):
                parts[name] = part
            else:
                errors[name] = f"must be an object of name: value, got {part!r}"
                parts[name] = {}
        items = [(str(k), v) for k, v in parts["targets"].items()]
        items += [(str(k), f"{v[0]}..{v[1]}" if isinstance(v, (list, tuple)) and len(v) == 2 else v)
                  for k, v in parts["bounds"].items()]
    else:
        errors = {}
        items = []
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                errors[part] = "expected name=value"
            else:
                items.append((key.strip(), value))
    targets: dict[str, float] = {}
    bounds: dict[str, tuple[int, int]] = {}
    for key, value in items:
        if key in TARGETS:
            seconds = _seconds(value)
            if seconds is None or not 0 < seconds < math.inf:
                errors[key] = f"must be a positive duration such as 1s or 150ms, got {value!r}"
            else:
                targets[key] = seconds
        elif key in TUNABLE:
            m = _RANGE.match(str(value))
            lo, hi = (int(m.group(1)), int(m.group(2))) if m else (0, -1)
            if not m or not 1 <= lo <= hi:
                errors[key] = f"must be a range lo..hi with 1 <= lo <= hi, got {value!r}"
            elif bad := field_errors({key: hi}):
                errors[key] = f"the upper bound {hi}: {bad[key]}"
            else:
                bounds[key] = (lo, hi)
        elif key not in errors:
            errors[key] = f"unknown; targets are {', '.join(TARGETS)}, bounds any of {', '.join(TUNABLE)}"
    if not targets and not errors:
        errors["targets"] = f"at least one of {', '.join(TARGETS)} is required"
    if errors:
        raise SpecError(errors)
    return Spec(targets, bounds)


def _seconds(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = _DURATION.match(str(value))
    if not m:
        return None
    return float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)


@dataclass(frozen=True)
class WindowStats:
    """What the controller reads of the recent window."""

    requests: int
    ttft_p99: float | None
    itl_p99: float | None  # p99 over requests of each one's longest inter-token gap (its worst stall)
    held_s: dict[HoldCause, float]  # queued request-seconds by cause
    kv_peak: float  # 0..1
    prefill_step_share: float  # share of steps that carried prefill chunks
    running_peak: int = 0  # the most sequences any iteration ran
    running_mean: float = 0.0  # the sequences running, averaged over the iterations' time
    decode_wait_p99: float | None = None  # p99 of the waits of decode steps that carried no prefill

    def fewer_seqs(self, max_num_seqs: int) -> int:
        """max_num_seqs cut by a quarter from what actually ran (lowering a limit the window never
        reached would change nothing), and never under `seqs_demand` (max_num_seqs itself when
        that leaves no cut)."""
        base = self.running_peak if 0 < self.running_peak < max_num_seqs else max_num_seqs
        cut = max(1, math.floor(base * 0.75), seqs_demand(self.running_mean))
        return cut if cut < base else max_num_seqs

    def decode_rows_stall(self, itl_target: float) -> bool:
        """Whether the steps that carried no prefill kept their decode rows past `itl_target`
        (their waits' p99): then the rows themselves, not a chunk beside them, make the stalls."""
        return self.decode_wait_p99 is not None and self.decode_wait_p99 > itl_target


def seqs_demand(running_mean: float) -> int:
    """The fewest max_num_seqs that serve a window's load: the sequences it ran on average. A step
    takes a fixed time plus a little per row, so at a limit L the engine serves about L / step(L)
    tokens per second, which falls under what the window asked of it (its mean m over step(m))
    once L < m, and the queue then grows for as long as the load lasts (Little's law;
    benchmarks/autopilot.py runs 44-45: cuts to 8 and 11 under a steady load, and the queue
    missed TTFT for 35 s after each)."""
    return math.ceil(running_mean - 1e-9)


def running_mean(iterations: Sequence[IterationStats]) -> float:
    """The sequences running, averaged over the iterations' step time (0 without any)."""
    busy = sum(it.duration_s for it in iterations)
    return sum(it.running * it.duration_s for it in iterations) / busy if busy > 0 else 0.0


@dataclass(frozen=True)
class DecodeGaps:
    """The inter-token gaps the window's decode rows waited: each iteration that decoded gave each
    of its decode rows a token one gap after the iteration before it ended (the first iteration of
    the window, with no iteration before it, is left out)."""

    starts: list[float]  # of each iteration that decoded, ascending
    gaps: list[float]

    @classmethod
    def of(cls, iterations: Sequence[IterationStats]) -> "DecodeGaps":
        kept = decode_waits(iterations)
        return cls([it.started_at for it, _ in kept], [wait for _, wait in kept])

    def of_request(self, first_token: float, finished: float) -> list[float]:
        """The gaps of the iterations that started while a request streamed (from its first token
        to its end): its own inter-token gaps, if it was never preempted."""
        return self.gaps[bisect.bisect_left(self.starts, first_token):bisect.bisect_left(self.starts, finished)]


def decode_waits(iterations: Sequence[IterationStats]) -> list[tuple[IterationStats, float]]:
    """Each iteration that decoded, in time order, with the wait its decode rows had for their
    token: from the end of the iteration before it to its own end (the first has none)."""
    its = sorted(iterations, key=lambda it: it.started_at)
    return [(it, it.started_at + it.duration_s - (prev.started_at + prev.duration_s))
            for prev, it in zip(its, its[1:]) if it.decode_tokens > 0]


def worst_gaps(requests: Sequence[RequestStats], gaps: DecodeGaps) -> list[float]:
    """Each streamed request's longest inter-token gap (requests with one token have none)."""
    return [max(g) for r in requests if r.first_token is not None and (g := gaps.of_request(r.first_token, r.finished))]


def window_stats(iterations: Sequence[IterationStats], requests: Sequence[RequestStats],
                 gaps: DecodeGaps | None = None, in_flight: Sequence[InFlightRequest] = (),
                 now: float | None = None) -> WindowStats:
    """The window as the rules read it (`gaps`: the iterations' DecodeGaps, when the caller has
    them). ITL p99 is the p99 over requests of their worst stall, so that, like TTFT p99, a target
    met means at most 1 % of requests missed it. The requests still `in_flight` at `now` count
    with what they have shown so far (a request still waiting, its wait; a stream, its worst gap
    yet): a lower bound of what they will show, and the backlog the finished ones cannot."""
    gaps = DecodeGaps.of(iterations) if gaps is None else gaps
    ttft = [r.first_token - r.arrival for r in requests if r.first_token is not None]
    worst = worst_gaps(requests, gaps)
    if in_flight:
        assert now is not None, "requests in flight are read at a moment"
        ttft += [(now if r.first_token is None else r.first_token) - r.arrival for r in in_flight]
        worst += [max(g) for r in in_flight if r.first_token is not None and (g := gaps.of_request(r.first_token, now))]
    held = {c: sum(getattr(it, c.column) * it.duration_s for it in iterations) for c in HoldCause}
    kv = max((it.kv_blocks_used / it.kv_blocks_total for it in iterations if it.kv_blocks_total), default=0.0)
    prefill = sum(1 for it in iterations if it.prefill_tokens > 0)
    decode_only = [wait for it, wait in decode_waits(iterations) if not it.prefill_tokens]
    return WindowStats(len(requests), p99(ttft), p99(worst), held, kv,
                       prefill / len(iterations) if iterations else 0.0, max((it.running for it in iterations), default=0),
                       running_mean(iterations), p99(decode_only))


def p99(values: Sequence[float]) -> float | None:
    """The p99 (linear interpolation, as appliance bench's), None of nothing."""
    return percentile(values, 99) if values else None


@dataclass(frozen=True)
class Move:
    changes: dict[str, int]
    reason: str


@dataclass(frozen=True)
class Choice:
    """The decision: a move (or None: hold), why, and the prediction behind it (None: the rules
    decided alone, or nothing was simulated)."""

    move: Move | None
    reason: str
    prediction: dict[str, Any] | None = None
    simulated: bool = False  # a replay ran (the controller spaces these out)


def decide(w: WindowStats, knobs: Knobs, spec: Spec, last_raise: dict[str, int] | None = None) -> Move | None:
    """The one move for this window, or None. `last_raise`: {knob: value before} of the most
    recent raise still in force (what relaxing gives back)."""
    if w.requests < MIN_REQUESTS:
        return None
    ttft_t, itl_t = spec.targets.get("ttft_p99"), spec.targets.get("itl_p99")
    ttft_over = ttft_t is not None and w.ttft_p99 is not None and w.ttft_p99 > ttft_t
    itl_over = itl_t is not None and w.itl_p99 is not None and w.itl_p99 > itl_t
    k = knobs.as_dict()
    if ttft_over:
        why = f"TTFT p99 {w.ttft_p99:.3f} s > target {ttft_t:.3f} s"
        total = sum(w.held_s.values())
        if total <= 0:
            return None
        cause = max(HoldCause, key=lambda c: w.held_s[c])
        share = f"{w.held_s[cause] / total:.0%} of queueing held by {cause}"
        if cause is HoldCause.MAX_NUM_SEQS:
            if w.kv_peak >= KV_ROOM:
                return None
            return bounded_move(knobs, spec, "max_num_seqs", math.ceil(k["max_num_seqs"] * 1.5),
                         f"{why}; {share}, KV peak {w.kv_peak:.0%}")
        if cause is HoldCause.TOKEN_BUDGET:
            return bounded_move(knobs, spec, "max_num_batched_tokens", math.ceil(k["max_num_batched_tokens"] * 1.5),
                         f"{why}; {share}")
        if cause is HoldCause.PARTIAL_PREFILLS:
            return bounded_move(knobs, spec, "max_num_partial_prefills", k["max_num_partial_prefills"] + 1, f"{why}; {share}")
        if cause is HoldCause.LONG_PARTIAL_PREFILLS:
            return bounded_move(knobs, spec, "max_long_partial_prefills", k["max_long_partial_prefills"] + 1,
                         f"{why}; {share}")
        return None  # free KV blocks: no knob here adds memory
    if itl_over:
        why = f"ITL p99 {w.itl_p99 * 1000:.0f} ms > target {itl_t * 1000:.0f} ms"
        if w.prefill_step_share > 0:
            move = bounded_move(knobs, spec, "long_prefill_token_threshold", max(1, k["long_prefill_token_threshold"] // 2),
                                f"{why}; {w.prefill_step_share:.0%} of steps carried prefill chunks")
            if move is not None:
                return move
        if not w.decode_rows_stall(itl_t):
            # only the chunk steps stall: a cut of max_num_seqs takes ~2 ms a row off a 170-300 ms
            # chunk step on a 2-core CPU, and the next load outgrows it (benchmarks/autopilot.py
            # runs 45-50: all eleven cuts to 8 were raised back while TTFT p99 reached 9-33 s)
            return None
        return bounded_move(knobs, spec, "max_num_seqs", w.fewer_seqs(k["max_num_seqs"]),
                            f"{why}; decode-only steps' waits p99 {w.decode_wait_p99 * 1000:.0f} ms")
    if relaxed(w, spec) and last_raise:
        return bounded_moves(knobs, spec, last_raise, f"TTFT and ITL p99 under {RELAX:.0%} of their targets: "
                                                      f"giving back the last raise of {', '.join(last_raise)}")
    return None


def relaxed(w: WindowStats, spec: Spec) -> bool:
    """Both percentiles of the window under RELAX x their targets (or without one): the relax
    rule may give back the last raise."""
    pairs = ((w.ttft_p99, spec.targets.get("ttft_p99")), (w.itl_p99, spec.targets.get("itl_p99")))
    return all(value is None or target is None or value < RELAX * target for value, target in pairs)


def kept_raise(knobs: Knobs, name: str, raised: Mapping[str, int] | None) -> int:
    """The value `name` holds while the autopilot's last raise of it is in force (`raised`:
    {knob: its value before}), else 0: the floor under which no move but the relax rule's takes it
    (`undoes_raise`; the stall cuts' floors, autopilot_stalls). A raise is made for TTFT, where a
    limit held the queue; lowering it for ITL gives the queue back and the TTFT rule raises it
    again (a flap: benchmarks/autopilot.py run 68, max_num_partial_prefills 1→2 for a TTFT p99 of
    6.1 s, and 14 s later a replay's 2→1 for ITL)."""
    return knobs.as_dict()[name] if raised and name in raised else 0


def undoes_raise(move: Move, knobs: Knobs, raised: Mapping[str, int] | None) -> bool:
    """Whether `move` lowers a knob under its `kept_raise` floor (only the relax rule may)."""
    return any(value < kept_raise(knobs, name, raised) for name, value in move.changes.items())


def bounded_move(knobs: Knobs, spec: Spec, name: str, wanted: int, reason: str) -> Move | None:
    """Set `name` to `wanted` clamped into the operator's bounds; None when that changes nothing
    or breaks a cross-knob rule."""
    return bounded_moves(knobs, spec, {name: wanted}, reason)


def bounded_moves(knobs: Knobs, spec: Spec, wanted: Mapping[str, int], reason: str) -> Move | None:
    """Set each knob of `wanted` to its value clamped into the operator's bounds, as one move;
    None when that changes nothing or the set breaks a cross-knob rule."""
    current = knobs.as_dict()
    changes = {}
    for name, value in wanted.items():
        lo, hi = spec.bound(name)
        if (value := min(hi, max(lo, value))) != current[name]:
            changes[name] = value
    if not changes:
        return None
    try:
        knobs.with_changes(changes)
    except KnobError:
        return None  # would break a cross-knob rule (e.g. budget >= max_num_seqs): no move
    said = ", ".join(f"{name} {current[name]}→{value}" for name, value in changes.items())
    return Move(changes, f"{said}: {reason}")
