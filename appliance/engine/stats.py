"""Records the engine publishes: one per iteration, one per finished request.

The engine only builds these plain records and hands them to its sinks; persisting them is the
telemetry store's job (the engine never imports a database).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class IterationStats:
    """What one engine iteration did."""

    iteration: int  # index of this iteration, from 0
    started_at: float  # wall clock (time.time()) when the iteration began
    duration_s: float  # wall time of the whole iteration (schedule + forward + postprocess)
    running: int  # sequences holding a running slot after scheduling
    waiting: int  # requests left waiting after scheduling
    prefill_seqs: int
    prefill_tokens: int
    decode_seqs: int
    decode_tokens: int
    scheduled_tokens: int  # prefill_tokens + decode_tokens (real work)
    padding_tokens: int  # rows computed only as padding (static policy's convoy), 0 when continuous
    token_budget: int  # max_num_batched_tokens in force
    max_num_seqs: int  # in force
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    preemptions: int  # sequences preempted during this iteration
    finished: int  # requests that ended during this iteration
    knob_version: int
    policy: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RequestStats:
    """Timeline and counts of one request, published once when it ends."""

    request_id: str
    source: str  # "api", "chat", "loadtest", "engine"
    run_id: str | None  # load-test run the request belongs to, if any
    arrival: float  # wall clock
    first_scheduled: float | None
    first_token: float | None
    finished: float
    prompt_tokens: int
    output_tokens: int
    finish_reason: str  # stop | length | abort | error
    preemptions: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class KnobChange:
    """One applied knob change: what changed, and the iteration at which it took effect."""

    version: int
    iteration: int  # first iteration that ran with the new values
    applied_at: float  # wall clock
    old: dict[str, Any]
    new: dict[str, Any]
    source: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StatsSink:
    """Receives engine records. Implementations must never block (the engine calls them inline)."""

    def on_iteration(self, stats: IterationStats) -> None:  # pragma: no cover - interface
        pass

    def on_request(self, stats: RequestStats) -> None:  # pragma: no cover - interface
        pass

    def on_knob_change(self, change: KnobChange) -> None:  # pragma: no cover - interface
        pass

