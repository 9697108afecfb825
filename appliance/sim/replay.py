"""Discrete-event replay of a workload through the engine's own Scheduler and BlockManager.

No model runs: the loop is the engine's (add arrivals and aborts at the iteration boundary,
schedule, run, sample one token per caught-up sequence, finish), the clock is virtual, and each
iteration lasts what a step timer says for its composition (a fitted StepTimeModel, or the
recorded durations of a real run). Every request is forced to its recorded/requested output
length. Prefix-cache hits are replayed as recorded: a request that found `cached_tokens` of its
prompt in the cache finds a prefix of that length resident when it arrives (seeded into the
engine's own BlockManager, so it is matched, evicted under pressure, or ignored with
`enable_prefix_caching` off exactly as the engine would). Each request's prefix is its own: a
prefix that concurrently running requests shared in one set of blocks takes one set per request
here, which overstates KV usage for such traffic. The result carries the same per-request records
and summary that `appliance bench` produces, and the per-iteration records the engine would have
published.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from appliance.bench.metrics import SLO, RequestResult, Summary, itl_from_times, summarize
from appliance.engine.block_manager import BlockManager
from appliance.engine.knobs import Knobs
from appliance.engine.sampling import SamplingParams
from appliance.engine.scheduler import Scheduler
from appliance.engine.sequence import Sequence as EngineSequence
from appliance.engine.sequence import Status
from appliance.engine.stats import IterationStats, decode_context_tokens, iteration_stats
from appliance.sim.fit import Composition

MAX_ITERATIONS = 5_000_000  # a bound on the loop; far beyond any workload here


class ReplayError(ValueError):
    """The workload cannot be replayed as given (e.g. a request the cache cannot hold)."""


@dataclass(frozen=True)
class SimRequest:
    """One request to replay: when it arrives (seconds from the run's start), its lengths, when
    the client gave up on it (seconds from the start; None: never), and how many of its prompt
    tokens were found in the prefix cache (0: none; whole blocks are matched)."""

    arrival: float
    prompt_tokens: int
    output_tokens: int
    cancel_at: float | None = None
    cached_tokens: int = 0


@dataclass(frozen=True)
class CacheShape:
    """The KV cache the engine was started with (fixed until restart)."""

    num_blocks: int
    block_size: int
    max_model_len: int


class StepTimer(Protocol):
    def step(self, c: Composition, u: float) -> tuple[float, float]:
        """(seconds the iteration takes, seconds of engine loop before the next one starts);
        `u` is the iteration's uniform draw in [0, 1) for a timer that models step-time spread."""


class RecordedSteps:
    """Step times taken in order from a recorded run's iterations: each lasts its recorded
    duration and the next starts when the recorded next one did (the replay then lands arrivals
    on the same iteration boundaries as the real engine did)."""

    def __init__(self, iterations: Sequence[IterationStats]):
        self._steps = [(it.duration_s, nxt.started_at - it.started_at - it.duration_s)
                       for it, nxt in zip(iterations, iterations[1:])]
        self._steps.append((iterations[-1].duration_s, 0.0) if iterations else (0.0, 0.0))
        self._next = 0

    def step(self, c: Composition, u: float) -> tuple[float, float]:
        if self._next >= len(self._steps):
            raise ReplayError(f"the replay ran more iterations than the {len(self._steps)} recorded")
        self._next += 1
        return self._steps[self._next - 1]


@dataclass
class ReplayResult:
    """What the replay produced: per-request results as `appliance bench` records them (times
    from each request's arrival), the summary, and the iterations (started_at on the virtual
    clock, seconds from the start)."""

    results: list[RequestResult]
    summary: Summary
    iterations: list[IterationStats]
    duration_s: float


def check_fits(requests: Sequence[SimRequest], cache: CacheShape) -> None:
    """Raise ReplayError naming the first request the engine would refuse or could never hold."""
    capacity = cache.num_blocks * cache.block_size
    for i, r in enumerate(requests):
        if r.prompt_tokens < 1 or r.output_tokens < 1:
            raise ReplayError(f"request {i}: prompt_tokens {r.prompt_tokens} and output_tokens {r.output_tokens} "
                              "must both be at least 1")
        total = r.prompt_tokens + r.output_tokens
        if total > cache.max_model_len:
            raise ReplayError(f"request {i}: {r.prompt_tokens} prompt + {r.output_tokens} output tokens = {total} "
                              f"exceeds max_model_len {cache.max_model_len}")
        if total > capacity:
            raise ReplayError(f"request {i}: {total} tokens do not fit in the KV cache "
                              f"(num_blocks {cache.num_blocks} x block_size {cache.block_size} = {capacity} tokens)")


def replay(
    requests: Sequence[SimRequest],
    knobs: Knobs,
    cache: CacheShape,
    timer: StepTimer,
    *,
    slo: SLO | None = None,
    concurrency: int | None = None,
    seed: int = 0,
) -> ReplayResult:
    """Replay `requests` under `knobs` on a `cache`-sized engine with `timer`'s step times.

    With `concurrency`, arrivals are closed-loop as `appliance bench --concurrency`: the first C
    requests arrive at 0 and each finished one lets the next arrive (their `arrival` is ignored).
    Iteration k draws the k-th number of a generator seeded with `seed` for its step-time spread,
    so replays compared under different knobs see the same draws (common random numbers).
    """
    if concurrency is not None and concurrency < 1:
        raise ReplayError(f"concurrency must be at least 1, got {concurrency}")
    check_fits(requests, cache)
    sim = _Replay(requests, knobs, cache, timer, concurrency, seed)
    sim.run()
    results = [sim.result(i) for i in range(len(requests))]
    duration = max([0.0, *(r.sent_at + (r.e2e or 0.0) for r in results), *sim.ended_at.values()])
    summary = summarize(results, max(duration, 1e-9), len(requests), slo)
    return ReplayResult(results, summary, sim.iterations, duration)


class _Replay:
    """The event loop's state: the engine's scheduler on a virtual clock."""

    def __init__(self, requests: Sequence[SimRequest], knobs: Knobs, cache: CacheShape, timer: StepTimer,
                 concurrency: int | None, seed: int):
        self.requests = list(requests)
        self.draws = random.Random(seed)
        self.cache = cache
        self.timer = timer
        self.now = 0.0
        blocks = BlockManager(cache.num_blocks, cache.block_size, enable_caching=knobs.enable_prefix_caching)
        self.scheduler = Scheduler(blocks, knobs, clock=lambda: self.now)
        self.iterations: list[IterationStats] = []
        self.seqs: dict[int, EngineSequence] = {}
        self.token_times: dict[int, list[float]] = {i: [] for i in range(len(requests))}
        self.ended_at: dict[int, float] = {}  # finished or cancelled
        self.arrived_at: dict[int, float] = {}
        self.cancelled: set[int] = set()
        self.concurrency = concurrency
        if concurrency is None:
            self.pending = sorted(range(len(requests)), key=lambda i: (requests[i].arrival, i))
            self.arrival_of = {i: max(0.0, requests[i].arrival) for i in range(len(requests))}
        else:
            self.pending = list(range(len(requests)))
            self.arrival_of = {i: 0.0 for i in range(min(concurrency, len(requests)))}
        self._next_pending = 0
        self._cancels: list[tuple[float, int]] = []

    # -- events -------------------------------------------------------------------------------
    def _next_arrival(self) -> float | None:
        if self._next_pending >= len(self.pending):
            return None
        return self.arrival_of.get(self.pending[self._next_pending])

    def _admit_arrivals(self) -> None:
        while (t := self._next_arrival()) is not None and t <= self.now:
            i = self.pending[self._next_pending]
            ticket = self._next_pending  # the engine's admission ticket: arrival order
            self._next_pending += 1
            r = self.requests[i]
            seq = EngineSequence(request_id=str(i), prompt_token_ids=self._prompt(i, r),
                                 params=SamplingParams(max_tokens=r.output_tokens, ignore_eos=True),
                                 detokenizer=None, arrival=t, arrival_order=ticket)  # type: ignore[arg-type]
            self.seqs[i] = seq
            self.arrived_at[i] = t
            self.scheduler.add(seq)
            if r.cancel_at is not None:
                heapq.heappush(self._cancels, (max(r.cancel_at, t), i))

    def _prompt(self, i: int, r: SimRequest) -> list[int]:
        """Request i's token ids: its own (no two requests share a token), starting with its
        recorded cached prefix, which is made resident in the cache now when caching is on."""
        bs = self.cache.block_size
        cached = min(r.cached_tokens, r.prompt_tokens - 1) // bs * bs  # the engine never matches the last token
        prefix = [-(i + 1)] * cached
        block_manager = self.scheduler.block_manager
        if cached and block_manager.enable_caching:
            holder = EngineSequence(request_id=f"prefix-{i}", prompt_token_ids=prefix,
                                    params=SamplingParams(max_tokens=1), detokenizer=None)  # type: ignore[arg-type]
            if block_manager.allocate(holder, cached):  # no room: the prefix was evicted, a miss
                holder.num_computed_tokens = cached
                block_manager.free(holder)  # caches its blocks, free for the request to match
        return prefix + [i + 1] * (r.prompt_tokens - cached)

    def _apply_cancels(self) -> None:
        while self._cancels and self._cancels[0][0] <= self.now:
            _, i = heapq.heappop(self._cancels)
            if i not in self.ended_at:
                self.cancelled.add(i)
                self._end(i)

    def _end(self, i: int) -> None:
        seq = self.seqs[i]
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        self.ended_at[i] = self.now
        if self.concurrency is not None:  # closed loop: the next request is sent now
            nxt = len(self.arrival_of)
            if nxt < len(self.requests):
                self.arrival_of[nxt] = self.now

    def _idle_until(self) -> float | None:
        times = [t for t in (self._next_arrival(), self._cancels[0][0] if self._cancels else None) if t is not None]
        return min(times) if times else None

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        for _ in range(MAX_ITERATIONS):
            self._admit_arrivals()
            self._apply_cancels()
            if not self.scheduler.has_unfinished():
                wake = self._idle_until()
                if wake is None:
                    return
                self.now = max(self.now, wake)
                continue
            self._iterate()
        raise ReplayError(f"the replay did not finish within {MAX_ITERATIONS} iterations")

    def _iterate(self) -> None:
        started = self.now
        sched = self.scheduler.schedule()
        if sched.is_empty:  # nothing fits now (cannot happen once check_fits passed); wait for an event
            wake = self._idle_until()
            if wake is None:
                raise ReplayError("the scheduler can schedule nothing and no event is pending")
            self.now = max(self.now, wake)
            return
        context = decode_context_tokens(sched)
        prefill_tokens = sum(s.num_tokens for s in sched.scheduled if s.is_prefill)
        composition = Composition(
            decode_rows=sum(1 for s in sched.scheduled if not s.is_prefill) + sched.padding_rows,
            prefill_tokens=prefill_tokens, prefill_seqs=sum(1 for s in sched.scheduled if s.is_prefill),
            decode_context_tokens=context)
        duration, gap = self.timer.step(composition, self.draws.random())
        self.now = started + duration
        finished = 0
        for item in sched.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_tokens
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that has not caught up: no token yet
            i = int(seq.request_id)
            seq.output_token_ids.append(0)
            self.token_times[i].append(self.now)
            if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.cache.max_model_len:
                self._end(i)
                finished += 1
        self.iterations.append(iteration_stats(
            sched, self.scheduler, iteration=len(self.iterations), started_at=started, duration_s=duration,
            finished=finished, decode_context_tokens=context, knob_version=0))
        self.now += max(0.0, gap)

    # -- results --------------------------------------------------------------------------------
    def result(self, i: int) -> RequestResult:
        r = self.requests[i]
        sent = self.arrived_at.get(i, 0.0)
        out = RequestResult(index=i, sent_at=sent, requested_output_len=r.output_tokens,
                            prompt_tokens=r.prompt_tokens)
        times = self.token_times[i]
        if i in self.cancelled or i not in self.ended_at:
            out.ok, out.error_kind = False, "cancelled"
            out.output_tokens = len(times)
            return out
        out.ok = True
        out.output_tokens = len(times)
        out.ttft = times[0] - sent
        out.itl = itl_from_times(times)
        out.e2e = self.ended_at[i] - sent
        out.finish_reason = "length"
        return out
