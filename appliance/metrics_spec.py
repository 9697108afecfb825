"""One declaration per recorded field.

The engine's records (appliance.records: IterationStats, RequestStats) declare each field once,
with `metric(...)`: its description, unit, chart label, whether the store rolls it up per
second, and how wide its column is. Everything else that lists those fields derives from
`metrics_of(record)`: the telemetry store's columns and rollup (appliance.telemetry.models),
the series that queries, charts and reports may read. The record's annotation gives the type.

This module only describes (it imports nothing of the appliance): the engine, the store and
the dashboard all read it, and the engine still imports nothing from the store or the dashboard.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

_KEY = "appliance.metric"


@dataclass(frozen=True)
class Metric:
    """One field of an engine record, as the code downstream of the engine needs to know it."""

    name: str
    type: type  # int, float, or str (or a str-valued enum)
    nullable: bool  # the value may be None
    description: str
    unit: str  # "s", "tokens", "sequences", "requests", "blocks"; "" when none
    label: str  # short name for charts and tables (the name when not given)
    rollup: bool  # aggregated per second (min, max, sum) by the store: a chartable series
    max_length: int | None  # str: the longest value stored
    wide: bool  # int: may exceed 32 bits


def metric(
    description: str,
    *,
    unit: str = "",
    label: str = "",
    rollup: bool = False,
    max_length: int | None = None,
    wide: bool = False,
) -> Any:
    """A dataclass field (no default) that carries its Metric declaration."""
    declared = {"description": description, "unit": unit, "label": label, "rollup": rollup,
                "max_length": max_length, "wide": wide}
    return field(metadata={_KEY: declared})


def metrics_of(record: type) -> tuple[Metric, ...]:
    """The Metric of every field of a record declared with `metric()`, in field order.
    Raises TypeError for a field that is undeclared or whose declaration cannot be stored."""
    hints = typing.get_type_hints(record)
    out = []
    for f in fields(record):
        declared = f.metadata.get(_KEY)
        if declared is None:
            raise TypeError(f"{record.__name__}.{f.name} is not declared with metric()")
        value_type, nullable = _split_optional(hints[f.name])
        m = Metric(name=f.name, type=value_type, nullable=nullable,
                   **{**declared, "label": declared["label"] or f.name})
        _check(record, m)
        out.append(m)
    return tuple(out)


def _split_optional(hint: Any) -> tuple[Any, bool]:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else hint), True
    return hint, False


def _check(record: type, m: Metric) -> None:
    where = f"{record.__name__}.{m.name}"
    if m.type not in (int, float) and not (isinstance(m.type, type) and issubclass(m.type, str)):
        raise TypeError(f"{where}: a metric is an int, a float or a str, not {m.type!r}")
    if issubclass(m.type, str) != (m.max_length is not None):
        raise TypeError(f"{where}: max_length is required for a str and only for a str")
    if m.wide and m.type is not int:
        raise TypeError(f"{where}: only an int can be wide")
    if m.rollup and (m.type not in (int, float) or m.nullable):
        raise TypeError(f"{where}: only a non-null int or float can be rolled up")
