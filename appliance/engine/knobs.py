"""The scheduler knobs an operator may change while traffic runs, and their one owner.

`Knobs` declares each knob once (type, bounds, description): its validation, the server's
JSON schema, the metrics and the history all come from that declaration, so adding a knob is
adding a field here (plus a cross-field rule in `_rule_errors` if it has one). `KnobState`
owns the knobs in force with their version and history; only the engine thread changes it,
through a `KnobUpdate`, and any thread reads one consistent `KnobSnapshot`.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, TypeAdapter, ValidationError

from ..policies import POLICIES
from .stats import KnobChange
from .validation import RequestErrorCode, problems

# Hard ceilings that keep a typo from exhausting memory; far above anything sensible here.
MAX_NUM_SEQS_LIMIT = 4096
MAX_BATCHED_TOKENS_LIMIT = 1 << 20

Seqs = Annotated[StrictInt, Field(ge=1, le=MAX_NUM_SEQS_LIMIT)]
Tokens = Annotated[StrictInt, Field(ge=1, le=MAX_BATCHED_TOKENS_LIMIT)]
_CHANGED: ContextVar[frozenset[str]] = ContextVar("knobs_changed", default=frozenset())  # for `blame`


class KnobError(ValueError):
    """A rejected knob set. `errors` maps each bad field to a message; nothing was applied."""

    def __init__(self, errors: Mapping[str, str]):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{k}: {v}" for k, v in self.errors.items()))


class Knobs(BaseModel):
    """Live scheduler settings (vLLM's names), always a valid set: building one with bad
    values, or `with_changes` that would make one, raises KnobError naming every bad field."""

    model_config = ConfigDict(frozen=True, extra="forbid", json_schema_serialization_defaults_required=True)

    max_num_seqs: Seqs = Field(64, description="running sequences at most")
    max_num_batched_tokens: Tokens = Field(512, description="token budget per iteration")
    long_prefill_token_threshold: Tokens = Field(256, description="prefill chunk size")
    max_num_partial_prefills: Seqs = Field(1, description="prompts prefilled concurrently")
    max_long_partial_prefills: Seqs = Field(1, description="long prompts prefilled concurrently")
    scheduling_policy: Literal[POLICIES] = Field("continuous", description="continuous or static batching")
    enable_prefix_caching: StrictBool = Field(True, description="reuse the KV blocks of cached prompt prefixes")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise KnobError(_field_errors(exc)) from None
        errors = _rule_errors(self, _CHANGED.get())
        if errors:
            raise KnobError(errors)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(cls.model_fields)

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def with_changes(self, changes: Mapping[str, Any]) -> "Knobs":
        """Return a new set with `changes` applied; raise KnobError naming every bad field.
        A cross-field rule broken by the change is reported on the field that changed."""
        return _checked({**self.as_dict(), **changes}, changed=set(changes))


def _checked(values: Mapping[str, Any], changed: set[str]) -> Knobs:
    token = _CHANGED.set(frozenset(changed))
    try:
        return Knobs(**values)
    finally:
        _CHANGED.reset(token)


def _field_errors(exc: ValidationError, root: tuple[str, ...] = ()) -> dict[str, str]:
    return {p.param: "unknown knob" if p.code is RequestErrorCode.UNRECOGNIZED else p.detail
            for p in problems(exc, root=root)}


def _rule_errors(knobs: Knobs, changed: frozenset[str]) -> dict[str, str]:
    """The cross-field rules, each reported on the first of its fields that `changed` names."""

    def blame(*names: str) -> str:
        return next((name for name in names if name in changed), names[0])

    k = knobs
    errors: dict[str, str] = {}
    if k.max_num_batched_tokens < k.max_num_seqs:
        errors[blame("max_num_batched_tokens", "max_num_seqs")] = (
            f"max_num_batched_tokens ({k.max_num_batched_tokens}) must be >= max_num_seqs ({k.max_num_seqs}) "
            "so every running sequence can decode each iteration"
        )
    if k.long_prefill_token_threshold > k.max_num_batched_tokens:
        errors[blame("long_prefill_token_threshold", "max_num_batched_tokens")] = (
            f"long_prefill_token_threshold ({k.long_prefill_token_threshold}) must be <= "
            f"max_num_batched_tokens ({k.max_num_batched_tokens})"
        )
    if k.max_long_partial_prefills > k.max_num_partial_prefills:
        errors[blame("max_long_partial_prefills", "max_num_partial_prefills")] = (
            f"max_long_partial_prefills ({k.max_long_partial_prefills}) must be <= "
            f"max_num_partial_prefills ({k.max_num_partial_prefills})"
        )
    return errors


def validate_knobs(values: Mapping[str, Any], only: set[str] | None = None) -> dict[str, str]:
    """{field: message} for every problem of a complete knob mapping (empty when valid);
    cross-field rules are reported on the fields in `only` when given."""
    try:
        _checked(values, changed=only or set())
    except KnobError as exc:
        return exc.errors
    return {}

def field_errors(values: Mapping[str, Any]) -> dict[str, str]:
    """Type and range problems of the knobs present in `values`, each on its own (no cross-field
    rules): {field: message}."""
    errors: dict[str, str] = {}
    for name, value in values.items():
        field = Knobs.model_fields.get(name)
        if field is None:
            errors[name] = "unknown knob"
            continue
        try:
            kind = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
            TypeAdapter(kind).validate_python(value)
        except ValidationError as exc:
            errors.update(_field_errors(exc, root=(name,)))
    return errors


# -- the owner ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KnobUpdate:
    """A requested change, carried from the caller to the engine thread. With
    `expected_version`, it applies only if the knobs in force still have that version (a
    controller's decision taken on older knobs is dropped: KnobConflict)."""

    changes: Mapping[str, Any]
    source: str = "api"
    reason: str | None = None
    prediction: Mapping[str, Any] | None = None
    expected_version: int | None = None


class KnobConflict(KnobError):
    """A KnobUpdate's expected_version is no longer the version in force; nothing was applied."""


@dataclass(frozen=True)
class KnobSnapshot:
    """The knobs in force, their version, the iteration it took effect at, and every change."""

    knobs: Knobs
    version: int = 0
    iteration: int = 0
    history: tuple[KnobChange, ...] = ()


class KnobState:
    """Owns the knobs in force. Only the engine thread calls `apply` (between iterations);
    readers on any thread take `snapshot`, one immutable object swapped in whole."""

    def __init__(self, knobs: Knobs):
        self.snapshot = KnobSnapshot(knobs)

    @property
    def knobs(self) -> Knobs:
        return self.snapshot.knobs

    def apply(self, update: KnobUpdate, iteration: int) -> KnobChange | None:
        """Validate the whole change (KnobError, nothing applied; KnobConflict when its
        expected_version is stale) and apply it; the first iteration to run with it is
        `iteration`. A change that changes nothing adds no version."""
        snap = self.snapshot
        if update.expected_version is not None and update.expected_version != snap.version:
            raise KnobConflict({"version": f"expected version {update.expected_version}, the knobs in force are "
                                           f"version {snap.version}"})
        knobs = snap.knobs.with_changes(update.changes)
        old, new = snap.knobs.as_dict(), knobs.as_dict()
        diff = [k for k in old if old[k] != new[k]]
        if not diff:
            return None
        change = KnobChange(snap.version + 1, iteration, time.time(), {k: old[k] for k in diff},
                            {k: new[k] for k in diff}, update.source, update.reason,
                            dict(update.prediction) if update.prediction is not None else None)
        self.snapshot = KnobSnapshot(knobs, change.version, iteration, (*snap.history, change))
        return change
