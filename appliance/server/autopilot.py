"""The SLO autopilot: a controller thread that reads the recent window of engine records and
turns the knobs itself, through the same validated path as an operator's PATCH (applied at an
iteration boundary, in knob history with source "autopilot", its reason and its prediction).
Given the engine's fixed settings it chooses with the what-if simulator fitted on the window
(autopilot_choice); without them, by the rules alone (autopilot_policy).

Guarantees: every move stays inside the operator's bounds (autopilot_policy); at most one move,
and one round of simulations (they share the CPU with serving), per `cooldown_s`, with one
exception that never reverses anything: a chunk cut that prefill steps under the new chunk still
stall past the ITL target is cut deeper (the seen-stall answer, a step-time fit and no replay)
`FOLLOW_UP_S` after it, at most once per such stall (a cut foreseen from the first few decode rows
can be short once more rows run, and ten seconds of stalls every stream in flight
misses); a knob changed
by anyone else pauses it for `manual_hold_s` and a decision taken before that change is dropped
(checked before applying, and by the engine itself: the move carries the knob version it was
decided on, KnobConflict when that is stale); switching it off stops it before its next move;
any error in the controller is logged and turns it off (serving is never touched: it decides in
its own thread, its simulations run in a worker process of their own when given one (the server
does: autopilot_worker; what needs no replay, a step-time fit at most, is decided in the
thread), and it only ever submits knob changes).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..engine import StatsSink
from ..engine.knobs import KnobConflict, KnobSnapshot
from ..records import InFlightRequest, IterationStats, KnobChange, RequestStats
from .autopilot_choice import BUDGET_S, choose
from .autopilot_policy import MIN_REQUESTS, Choice, Move, Spec, decide, window_stats
from .autopilot_slots import floored, long_slots_floor
from .autopilot_stalls import KNOB as CHUNK, chunk_cut
from .autopilot_worker import ChoiceWorker

log = logging.getLogger(__name__)

SOURCE = "autopilot"
WINDOW_S = 30.0
INTERVAL_S = 2.0
# a prefill step wakes the thread before INTERVAL_S (see `on_iteration`), at most this often
WAKE_SPACING_S = 0.5
COOLDOWN_S = 10.0
# a chunk cut still stalled past the ITL target is deepened this long after it, inside the cooldown
FOLLOW_UP_S = 2.0
MANUAL_HOLD_S = 60.0
HISTORY = 50
# the engine's latest steps of each kind (with prefill tokens, decode only) kept beyond the window:
# they price a chunk the window has not yet (autopilot_stalls.foresight)
KEPT_STEPS = 100

# submit a change through the knob path (keywords: reason, prediction, expected_version); None: no change
Apply = Callable[..., KnobChange | None]


class Autopilot(StatsSink):
    """Add it to the engine's sinks; `tick(now)` takes one decision (the thread calls it every
    INTERVAL_S, and sooner when a prefill step wakes it; tests call it directly)."""

    def __init__(self, knobs: Callable[[], KnobSnapshot], apply: Apply | None = None, spec: Spec | None = None, *,
                 fixed: Callable[[], Mapping[str, Any]] | None = None, window_s: float = WINDOW_S,
                 cooldown_s: float = COOLDOWN_S, manual_hold_s: float = MANUAL_HOLD_S,
                 clock: Callable[[], float] = time.time, worker: ChoiceWorker | None = None,
                 replay_budget_s: float = BUDGET_S, in_flight: Callable[[], Sequence[InFlightRequest]] | None = None):
        self._knobs, self._apply, self._fixed, self._clock = knobs, apply, fixed, clock
        self._in_flight = in_flight  # the engine's unfinished requests (LLMEngine.in_flight), read at each decision
        self._worker = worker  # where simulations run (None: in the caller's thread)
        self.replay_budget_s = replay_budget_s  # no replay of a round starts after this long
        self.spec = spec
        self.enabled = spec is not None
        self.window_s, self.cooldown_s, self.manual_hold_s = window_s, cooldown_s, manual_hold_s
        self.status = "watching" if self.enabled else "off"
        self.moves: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.last_decision: dict[str, Any] | None = None  # {"at", "reason"} of the latest decision
        self.error: str | None = None  # why it turned itself off (cleared when switched on again)
        self._iterations: deque[IterationStats] = deque()
        self._requests: deque[RequestStats] = deque()
        self._kept = {True: deque(maxlen=KEPT_STEPS), False: deque(maxlen=KEPT_STEPS)}  # by "carried prefill"
        self._lock = threading.Lock()
        self._last_move_at = float("-inf")
        self._last_sim_at = float("-inf")  # replays cost CPU beside the engine: one round per cooldown
        self._manual_at = float("-inf")
        self._manual_seq = 0  # counts knob changes by others; a decision spanning one is dropped
        self._last_raise: dict[str, int] = {}
        # the operator's values: the knobs in force when it was switched on or a person last changed them
        self._operator: dict[str, Any] = knobs().knobs.as_dict() if self.enabled else {}
        self._cut_at = float("-inf")  # when the chunk was last cut, while that is the latest move
        self._stall_at = float("-inf")  # the latest prefill step longer than the ITL target
        self._follow_up_at = float("-inf")  # the latest deeper-cut decision inside a cooldown
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # -- engine thread (sink) -----------------------------------------------------------------
    def on_iteration(self, stats: IterationStats) -> None:
        """Record the step; wake the thread for a decision now when the step carried prefill
        tokens and either the window is too small to replay (foresight prices a whole chunk from
        such steps: the interval's phase could let the first long prompt stall every stream before
        the next tick) or it kept its decode rows past the ITL target (a stall the chunk may
        explain), outside the cooldown. Cheap: a few comparisons in the engine's thread."""
        with self._lock:
            self._iterations.append(stats)
            self._kept[stats.prefill_tokens > 0].append(stats)
            spec = self.spec
            stall = (spec is not None and stats.prefill_tokens > 0
                     and stats.duration_s > spec.targets.get("itl_p99", float("inf")))
            if stall:
                self._stall_at = stats.started_at
            wake = self.enabled and stats.prefill_tokens > 0 and (
                (stats.started_at - max(self._last_move_at, self._last_sim_at) >= self.cooldown_s
                 and (len(self._requests) < MIN_REQUESTS or stall))
                or self._follow_up_due(stats.started_at))
        if wake:
            self._wake.set()

    def on_request(self, stats: RequestStats) -> None:
        with self._lock:
            self._requests.append(stats)

    def on_knob_change(self, change: KnobChange) -> None:
        if change.source != SOURCE:
            with self._lock:
                self._manual_at = change.applied_at
                self._manual_seq += 1
                self._last_raise = {}  # the operator's values are the new baseline
                self._operator.update(change.new)
                self._cut_at = float("-inf")

    # -- control --------------------------------------------------------------------------------
    def configure(self, enabled: bool | None = None, spec: Spec | None = None) -> None:
        """Switch on/off and/or replace the spec; switching on needs a spec, starts the
        simulations' worker and wakes the thread for a first decision (foresight may cut the
        chunk before the first prompt stalls a stream)."""
        operator = self._knobs().knobs.as_dict() if enabled else None
        with self._lock:
            if spec is not None:
                self.spec = spec
            if enabled is not None:
                if enabled and self.spec is None:
                    raise ValueError("the autopilot needs targets before it can be switched on")
                if operator is not None and not self.enabled:  # switched on: the knobs in force are the operator's
                    self._operator = operator
                self.enabled = enabled
                self.status = "watching" if enabled else "off"
                if enabled:
                    self.error = None
        if enabled:
            self._start_worker()
            self._wake.set()

    def view(self) -> dict[str, Any]:
        with self._lock:
            return {"enabled": self.enabled, "status": self.status, "error": self.error,
                    "spec": self.spec.as_dict() if self.spec else None,
                    "window_s": self.window_s, "cooldown_s": self.cooldown_s, "manual_hold_s": self.manual_hold_s,
                    "simulator": self._fixed is not None, "last_decision": self.last_decision,
                    "moves": list(self.moves)}

    def tick(self, now: float | None = None) -> Move | None:
        """One decision over the last window_s; applies and returns the move, if any. Never raises:
        an error turns the autopilot off."""
        now = self._clock() if now is None else now
        try:
            with self._lock:
                self._trim(now)
                if not self.enabled or self.spec is None:
                    return None
                if now - self._manual_at < self.manual_hold_s:
                    self.status = "holding: a knob was changed by hand"
                    return None
                self.status = "watching"
                follow_up = now - max(self._last_move_at, self._last_sim_at) < self.cooldown_s
                if follow_up and not self._follow_up_due(now):
                    return None  # at most one move, and one simulated decision, per cooldown
                if follow_up:
                    self._follow_up_at = now
                iterations, requests = list(self._iterations), list(self._requests)
                kept = sorted([*self._kept[True], *self._kept[False]], key=lambda it: it.started_at)
                seq, spec = self._manual_seq, self.spec
                # a raise is given back only once a whole window has been read under it (hysteresis:
                # a burst that ends just after a raise does not undo it ten seconds later)
                raised = dict(self._last_raise)  # in force: no stall cut undoes it (autopilot_policy.kept_raise)
                operator = dict(self._operator)
                last_raise = raised if now - self._last_move_at >= self.window_s else {}
            snap = self._knobs()
            pending = list(self._in_flight()) if self._in_flight is not None else []
            if follow_up:  # only a stall seen under the cut deepens it: no foresight, no replay
                assert self._fixed is not None  # _follow_up_due holds only with the fixed settings
                fixed = self._fixed()
                slots = long_slots_floor(iterations, requests, pending, snap.knobs, fixed, now)
                choice = chunk_cut(iterations, snap.knobs, floored(spec, snap.knobs, slots), fixed, foresee=False,
                                   raised=raised)
                if choice is None:
                    return None
            else:
                choice = self._choose(iterations, requests, snap.knobs, spec, last_raise, kept, raised, operator,
                                      pending, now)
            with self._lock:
                if choice.move is None and choice.reason != (self.last_decision or {}).get("reason"):
                    log.info("autopilot: %s", choice.reason)  # a hold, logged when its reason changes
                self.last_decision = {"at": now, "reason": choice.reason}
                if choice.simulated:
                    self._last_sim_at = now
                if choice.move is None or not self.enabled or seq != self._manual_seq:
                    return None  # nothing to do, or switched off / a person changed knobs while deciding
            move = choice.move
            if self._apply is None:
                raise RuntimeError("the autopilot has no knob path to apply moves through")
            try:
                change = self._apply(move.changes, reason=choice.reason, prediction=choice.prediction,
                                     expected_version=snap.version)
            except KnobConflict:
                with self._lock:
                    self.last_decision = {"at": now, "reason": "dropped: the knobs changed while deciding"}
                return None
            if change is None:  # the knobs already had these values: nothing moved
                return None
            with self._lock:
                self._last_move_at = now
                before = snap.knobs.as_dict()
                if raises := {name: before[name] for name, value in move.changes.items() if value > before[name]}:
                    self._last_raise = raises  # the relax rule gives them back together
                elif self._last_raise.keys() & move.changes.keys():
                    self._last_raise = {}
                self._cut_at = now if move.changes.get(CHUNK, before[CHUNK]) < before[CHUNK] else float("-inf")
                self.moves.append({"at": now, "version": change.version, "changes": move.changes,
                                   "reason": choice.reason, "prediction": choice.prediction})
                # drop the window: the next decision reads traffic under the new knobs only
                self._iterations.clear()
                self._requests.clear()
            log.info("autopilot: %s", choice.reason)
            return move
        except Exception as exc:  # noqa: BLE001 - a controller bug must never reach serving
            log.exception("autopilot failed; switching it off")
            self._turn_off(exc)
            return None

    def _choose(self, iterations: list[IterationStats], requests: list[RequestStats], knobs: Any, spec: Spec,
                last_raise: dict[str, int], kept: list[IterationStats], raised: dict[str, int],
                operator: dict[str, Any], in_flight: list[InFlightRequest], now: float) -> Choice:
        """By simulation when the engine's fixed settings are known, else by the rules alone
        (`kept`: the engine's latest steps, beyond the window; `last_raise`: the raise the relax
        rule may give back, once a window has been read under it; `raised`: the raise in force;
        `operator`: the operator's knob values, autopilot_stalls.raise_stalls; `in_flight`: the
        requests unfinished at `now`, autopilot_choice.replayed)."""
        if self._fixed is not None:
            return choose(iterations, requests, knobs, spec, self._fixed(), last_raise, kept, raised, operator,
                          in_flight, now, budget_s=self.replay_budget_s,
                          run=self._worker.replayed if self._worker is not None else None)
        move = decide(window_stats(iterations, requests, in_flight=in_flight, now=now), knobs, spec, last_raise)
        return Choice(move, move.reason if move else "hold: the rules propose nothing")

    def _follow_up_due(self, now: float) -> bool:
        """Whether a deeper cut of the chunk may be decided now, inside the cooldown (under the
        lock): the latest move cut the chunk at least FOLLOW_UP_S ago, a prefill step since the
        cut (and since the last such decision) took longer than the ITL target, and the last such
        decision was at least FOLLOW_UP_S ago."""
        return (self._fixed is not None and FOLLOW_UP_S <= now - self._cut_at < self.cooldown_s
                and self._stall_at > max(self._cut_at, self._follow_up_at)
                and now - self._follow_up_at >= FOLLOW_UP_S)

    def _trim(self, now: float) -> None:
        while self._iterations and self._iterations[0].started_at < now - self.window_s:
            self._iterations.popleft()
        while self._requests and self._requests[0].finished < now - self.window_s:
            self._requests.popleft()

    # -- thread -----------------------------------------------------------------------------------
    def start(self, apply: Apply | None = None, interval_s: float = INTERVAL_S) -> None:
        if apply is not None:
            self._apply = apply

        def run() -> None:
            last = time.monotonic()
            while not self._stop.is_set():
                self._wake.wait(max(0.0, last + interval_s - time.monotonic()))
                self._wake.clear()
                if self._stop.wait(max(0.0, last + WAKE_SPACING_S - time.monotonic())):
                    return
                last = time.monotonic()
                self.tick()

        if self.enabled:
            self._start_worker()
        self._thread = threading.Thread(target=run, name="autopilot", daemon=True)
        self._thread.start()

    def _start_worker(self) -> None:
        """Start the simulations' worker (and its imports) as soon as the autopilot is on; a
        worker that cannot start turns the autopilot off, as any controller error does."""
        if self._worker is None or self._fixed is None:
            return
        try:
            self._worker.start()
        except Exception as exc:  # noqa: BLE001 - never reaches serving (a PATCH or the server's start)
            log.exception("the autopilot's worker did not start; switching it off")
            self._turn_off(exc)

    def _turn_off(self, exc: BaseException) -> None:
        with self._lock:
            self.enabled = False
            self.error = f"{type(exc).__name__}: {exc}"
            self.status = f"off after an error: {self.error}"

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._worker is not None:
            self._worker.close()


def loop_apply(aeng: Any, loop: asyncio.AbstractEventLoop, timeout_s: float = 30.0) -> Apply:
    """Apply a change from the controller thread through AsyncEngine.update_knobs (the path a
    PATCH takes) on the server's event loop, waiting until it took effect."""
    def apply(changes: dict[str, int], **why: Any) -> KnobChange | None:
        future = asyncio.run_coroutine_threadsafe(aeng.update_knobs(changes, source=SOURCE, **why), loop)
        return future.result(timeout_s)

    return apply
