"""The engine's stats sinks, the records it hands them (declared in appliance.records), and how
one iteration's record is built from its schedule (by the engine, and by the simulator)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..records import (  # noqa: F401 - the engine's records, re-exported where the engine names them
    FinishReason,
    HoldCause,
    InFlightRequest,
    IterationStats,
    KnobChange,
    RequestStats,
)

if TYPE_CHECKING:
    from .scheduler import Scheduler, SchedulerOutput


def decode_context_tokens(sched: "SchedulerOutput") -> int:
    """Tokens the decode rows of a schedule attend to: each row's computed context plus its new
    token (taken before the step runs). The attention cost of an iteration grows with it."""
    return sum(s.seq.num_computed_tokens + s.num_tokens for s in sched.scheduled if not s.is_prefill)


def iteration_stats(
    sched: "SchedulerOutput",
    scheduler: "Scheduler",
    *,
    iteration: int,
    started_at: float,
    duration_s: float,
    finished: int,
    decode_context_tokens: int,
    knob_version: int,
    sample_s: float = 0.0,
) -> IterationStats:
    """The record of one iteration, from its schedule and the scheduler's state after it (the
    engine publishes these; the simulator builds the same records on its virtual clock, with
    sample_s 0: it does not model the time after the forward pass)."""
    prefill = [s for s in sched.scheduled if s.is_prefill]
    decode_tokens = sum(s.num_tokens for s in sched.scheduled if not s.is_prefill)
    prefill_tokens = sum(s.num_tokens for s in prefill)
    bm = scheduler.block_manager
    knobs = scheduler.knobs
    return IterationStats(
        iteration=iteration, started_at=started_at, duration_s=duration_s, sample_s=sample_s,
        running=len(scheduler.running), waiting=len(scheduler.waiting),
        prefill_seqs=len(prefill), prefill_tokens=prefill_tokens,
        decode_seqs=len(sched.scheduled) - len(prefill), decode_tokens=decode_tokens,
        scheduled_tokens=prefill_tokens + decode_tokens, padding_tokens=sched.padding_rows,
        token_budget=knobs.max_num_batched_tokens, max_num_seqs=knobs.max_num_seqs,
        kv_blocks_used=bm.num_used_blocks, kv_blocks_free=bm.num_free_blocks,
        kv_blocks_total=bm.num_blocks, kv_blocks_cached_free=bm.num_cached_free_blocks,
        prefix_cache_queries=sched.prefix_cache_queries, prefix_cache_hits=sched.prefix_cache_hits,
        preemptions=len(sched.preempted), finished=finished, knob_version=knob_version, policy=knobs.scheduling_policy,
        decode_context_tokens=decode_context_tokens,
        chunk_deferred_tokens=sched.chunk_deferred_tokens,
        **{cause.column: sched.held.get(cause, 0) for cause in HoldCause},
    )


class StatsSink:
    """Receives engine records. Implementations must never block (the engine calls them inline)."""

    def on_iteration(self, stats: IterationStats) -> None:  # pragma: no cover - interface
        pass

    def on_request(self, stats: RequestStats) -> None:  # pragma: no cover - interface
        pass

    def on_knob_change(self, change: KnobChange) -> None:  # pragma: no cover - interface
        pass
