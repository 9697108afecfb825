"""The scheduler knobs an operator may change while traffic runs, validated as one set."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from ..numeric import is_int
from ..policies import POLICIES

# Hard ceilings that keep a typo from exhausting memory; far above anything sensible here.
MAX_NUM_SEQS_LIMIT = 4096
MAX_BATCHED_TOKENS_LIMIT = 1 << 20


class KnobError(ValueError):
    """A rejected knob set. `errors` maps each bad field to a message; nothing was applied."""

    def __init__(self, errors: Mapping[str, str]):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{k}: {v}" for k, v in self.errors.items()))


@dataclass(frozen=True)
class Knobs:
    """Live scheduler settings (vLLM's names). Build with `Knobs.validated` or `with_changes`."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    long_prefill_token_threshold: int = 256  # the operator's "prefill chunk size"
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    scheduling_policy: str = "continuous"
    enable_prefix_caching: bool = True  # reuse cached KV blocks of equal prompt prefixes

    def __post_init__(self) -> None:
        errors = validate_knobs(asdict(self))
        if errors:
            raise KnobError(errors)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_changes(self, changes: Mapping[str, Any]) -> "Knobs":
        """Return a new set with `changes` applied; raise KnobError naming every bad field."""
        unknown = [k for k in changes if k not in self.names()]
        errors = {k: "unknown knob" for k in unknown}
        merged = {**asdict(self), **{k: v for k, v in changes.items() if k not in unknown}}
        errors.update(validate_knobs(merged, only=set(changes) - set(unknown)))
        if errors:
            raise KnobError(errors)
        return replace(self, **{k: v for k, v in changes.items()})


def validate_knobs(values: Mapping[str, Any], only: set[str] | None = None) -> dict[str, str]:
    """Check a complete knob mapping; return {field: message} for every problem found.

    Type and range errors are reported for each field; cross-field rules are reported on the
    field(s) that changed when `only` is given, so the operator sees what to fix.
    """
    errors: dict[str, str] = {}
    int_limits = {
        "max_num_seqs": MAX_NUM_SEQS_LIMIT,
        "max_num_batched_tokens": MAX_BATCHED_TOKENS_LIMIT,
        "long_prefill_token_threshold": MAX_BATCHED_TOKENS_LIMIT,
        "max_num_partial_prefills": MAX_NUM_SEQS_LIMIT,
        "max_long_partial_prefills": MAX_NUM_SEQS_LIMIT,
    }
    for name, ceiling in int_limits.items():
        value = values.get(name)
        if not is_int(value):
            errors[name] = f"must be an integer, got {value!r}"
        elif not 1 <= value <= ceiling:
            errors[name] = f"must be between 1 and {ceiling}, got {value}"
    policy = values.get("scheduling_policy")
    if policy not in POLICIES:
        errors["scheduling_policy"] = f"must be one of {', '.join(POLICIES)}, got {policy!r}"
    caching = values.get("enable_prefix_caching")
    if not isinstance(caching, bool):
        errors["enable_prefix_caching"] = f"must be true or false, got {caching!r}"
    if errors:
        return errors

    def blame(*names: str) -> str:
        if only:
            for name in names:
                if name in only:
                    return name
        return names[0]

    seqs, budget = values["max_num_seqs"], values["max_num_batched_tokens"]
    chunk = values["long_prefill_token_threshold"]
    partial, long_partial = values["max_num_partial_prefills"], values["max_long_partial_prefills"]
    if budget < seqs:
        errors[blame("max_num_batched_tokens", "max_num_seqs")] = (
            f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({seqs}) "
            "so every running sequence can decode each iteration"
        )
    if chunk > budget:
        errors[blame("long_prefill_token_threshold", "max_num_batched_tokens")] = (
            f"long_prefill_token_threshold ({chunk}) must be <= max_num_batched_tokens ({budget})"
        )
    if long_partial > partial:
        errors[blame("max_long_partial_prefills", "max_num_partial_prefills")] = (
            f"max_long_partial_prefills ({long_partial}) must be <= "
            f"max_num_partial_prefills ({partial})"
        )
    return errors
