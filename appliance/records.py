"""What is recorded: the engine's records (one per iteration, one per finished request, one per
knob change) and the values stored for finish reasons and run statuses.

The engine builds these plain records and hands them to its sinks (appliance.engine.stats);
persisting them is the telemetry store's job. Each field of IterationStats and RequestStats is
declared once, here, with `metric()`: the store's columns and rollup, and the series that
charts and reports may read, are derived from ITERATION_METRICS / REQUEST_METRICS.

A leaf module outside `appliance.engine`, so the store and the dashboard can read the
vocabulary without loading the engine package.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from appliance.metrics_spec import Metric, metric, metrics_of


class StrEnum(str, Enum):
    """A str-valued enum that is its value wherever a string is expected: in comparisons,
    str(), f-strings, JSON and SQL (stored values stay the same strings)."""

    def __str__(self) -> str:
        return str(self.value)


class FinishReason(StrEnum):
    """Why a request ended (OpenAI's `finish_reason`, plus vLLM's "abort" and "error")."""

    STOP = "stop"  # an EOS token, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length reached
    ABORT = "abort"  # the client went away or the request was aborted
    ERROR = "error"  # the model failed on this request's batch


COMPLETED_REASONS = (FinishReason.STOP, FinishReason.LENGTH)  # the request ran to its natural end
FAILED_REASONS = (FinishReason.ABORT, FinishReason.ERROR)  # it was cut short


class RunStatus(StrEnum):
    """A run's status: RUNNING until it ends with one of the others (FINAL)."""

    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # the server stopped while the run was going


FINAL_STATUSES: tuple[RunStatus, ...] = tuple(s for s in RunStatus if s is not RunStatus.RUNNING)


class HoldCause(StrEnum):
    """Why a waiting request was not admitted in an iteration: the limit the scheduler's
    admission stopped at (the value is the knob's name, or the resource's)."""

    MAX_NUM_SEQS = "max_num_seqs"
    TOKEN_BUDGET = "max_num_batched_tokens"
    KV_BLOCKS = "kv_blocks"
    PARTIAL_PREFILLS = "max_num_partial_prefills"
    LONG_PARTIAL_PREFILLS = "max_long_partial_prefills"

    @property
    def column(self) -> str:
        """The IterationStats field (and store column) that counts this cause."""
        return f"held_by_{self.name.lower()}"


@dataclass(frozen=True)
class IterationStats:
    """What one engine iteration did."""

    iteration: int = metric("index of this iteration, from 0", wide=True)
    started_at: float = metric("wall clock (time.time()) when the iteration began", unit="s")
    duration_s: float = metric("wall time of the whole iteration (schedule + forward + postprocess)",
                               unit="s", label="step time", rollup=True)
    sample_s: float = metric("wall time after the forward pass: sampling, detokenizing, stop checks",
                             unit="s", label="sampling time", rollup=True)
    running: int = metric("sequences holding a running slot after scheduling", unit="sequences", rollup=True)
    waiting: int = metric("requests left waiting after scheduling", unit="requests", rollup=True)
    prefill_seqs: int = metric("sequences given a prefill chunk", unit="sequences", rollup=True)
    prefill_tokens: int = metric("prompt tokens computed", unit="tokens", label="prefill", rollup=True)
    decode_seqs: int = metric("sequences given a decode step", unit="sequences", rollup=True)
    decode_tokens: int = metric("tokens decoded", unit="tokens", label="decode", rollup=True)
    scheduled_tokens: int = metric("prefill_tokens + decode_tokens (real work)", unit="tokens", rollup=True)
    padding_tokens: int = metric("rows computed only as padding (static policy's convoy), 0 when continuous",
                                 unit="tokens", label="padding", rollup=True)
    token_budget: int = metric("max_num_batched_tokens in force", unit="tokens",
                               label="max_num_batched_tokens", rollup=True)
    max_num_seqs: int = metric("max_num_seqs in force", unit="sequences", rollup=True)
    kv_blocks_used: int = metric("KV cache blocks in use", unit="blocks", rollup=True)
    kv_blocks_free: int = metric("KV cache blocks free", unit="blocks", rollup=True)
    kv_blocks_total: int = metric("KV cache blocks in all", unit="blocks", rollup=True)
    preemptions: int = metric("sequences preempted during this iteration", unit="sequences", rollup=True)
    finished: int = metric("requests that ended during this iteration", unit="requests", rollup=True)
    knob_version: int = metric("version of the knob set in force", rollup=True)
    held_by_max_num_seqs: int = metric("waiting requests not admitted because max_num_seqs were running",
                                       unit="requests", label="held: max_num_seqs", rollup=True)
    held_by_token_budget: int = metric("waiting requests not admitted because the token budget was used up",
                                       unit="requests", label="held: token budget", rollup=True)
    held_by_kv_blocks: int = metric("waiting requests not admitted for lack of free KV blocks "
                                    "(or because a preemption happened this iteration)",
                                    unit="requests", label="held: KV blocks", rollup=True)
    held_by_partial_prefills: int = metric("waiting requests not admitted because max_num_partial_prefills "
                                           "prefills were unfinished", unit="requests",
                                           label="held: partial prefills", rollup=True)
    held_by_long_partial_prefills: int = metric("long-prompt requests skipped because "
                                                "max_long_partial_prefills long prefills were unfinished",
                                                unit="requests", label="held: long partial prefills",
                                                rollup=True)
    chunk_deferred_tokens: int = metric("prefill tokens that fitted the budget but were left for later "
                                        "iterations by long_prefill_token_threshold", unit="tokens",
                                        label="deferred by chunk", rollup=True)
    policy: str = metric("scheduling policy in force", max_length=32)
    decode_context_tokens: int | None = metric(
        "tokens the decode rows attend to (each row's context and its new token); None on rows stored "
        "before migration 0003", unit="tokens")
    kv_blocks_cached_free: int = metric("free KV blocks that still hold a cached prefix (part of kv_blocks_free)",
                                        unit="blocks", label="cached free", rollup=True)
    prefix_cache_queries: int = metric("tokens of the sequences admitted this iteration, looked up in the prefix cache",
                                       unit="tokens", label="looked up", rollup=True)
    prefix_cache_hits: int = metric("of those, tokens served from the prefix cache instead of computed",
                                    unit="tokens", label="from cache", rollup=True)

    def as_dict(self) -> dict[str, Any]:
        """The fields by name (all scalars: dataclasses.asdict's deep copy took ~25 us a
        row: most of the autopilot's slots count over a window of ~900 steps)."""
        return dict(vars(self))


@dataclass(frozen=True)
class RequestStats:
    """Timeline and counts of one request, published once when it ends."""

    request_id: str = metric("the request's id as the server named it", max_length=128)
    source: str = metric('who sent it: "api", "chat", "loadtest" or "engine"', max_length=16)
    run_id: str | None = metric("load-test run the request belongs to, if any", max_length=36)
    arrival: float = metric("wall clock when the request arrived", unit="s")
    first_scheduled: float | None = metric("wall clock when it was first scheduled", unit="s")
    first_token: float | None = metric("wall clock when its first token was sampled", unit="s")
    finished: float = metric("wall clock when it ended", unit="s")
    prompt_tokens: int = metric("tokens in the prompt", unit="tokens")
    output_tokens: int = metric("tokens generated", unit="tokens")
    finish_reason: FinishReason = metric("why it ended", max_length=16)
    preemptions: int = metric("times it was preempted")
    cached_tokens: int = metric("prompt tokens served from the prefix cache at its first admission", unit="tokens")

    def as_dict(self) -> dict[str, Any]:
        """The fields by name (all scalars: dataclasses.asdict's deep copy took ~25 us a
        row)."""
        return dict(vars(self))


@dataclass(frozen=True)
class InFlightRequest:
    """A request the engine has not finished, as `LLMEngine.in_flight` reads it at one moment (not
    stored: the autopilot's view of the backlog its finished requests cannot show)."""

    arrival: float  # wall clock, s
    prompt_tokens: int
    output_tokens: int  # generated so far
    max_tokens: int  # the most it may generate (its sampling parameters; validated to fit the context)
    first_token: float | None  # wall clock of its first token; None while it waits for it
    cached_tokens: int  # prompt tokens served from the prefix cache (0 until it is first admitted)


@dataclass(frozen=True)
class KnobChange:
    """One applied knob change: what changed, and the iteration at which it took effect; who
    changed it, why (the autopilot always says; a person may) and, for the autopilot's moves, what
    the simulator predicted (e.g. {"before": {...}, "after": {...}} of attainment and p99s)."""

    version: int
    iteration: int  # first iteration that ran with the new values
    applied_at: float  # wall clock
    old: dict[str, Any]
    new: dict[str, Any]
    source: str
    reason: str | None = None
    prediction: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


ITERATION_METRICS: tuple[Metric, ...] = metrics_of(IterationStats)
REQUEST_METRICS: tuple[Metric, ...] = metrics_of(RequestStats)
