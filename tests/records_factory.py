"""Engine records for tests, built from their declarations (appliance.records): every field a
test does not give is zero, None or the usual word, so adding a metric edits no test helper."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from appliance.records import FinishReason, IterationStats, RequestStats

WORDS = {"policy": "continuous", "source": "api", "finish_reason": FinishReason.LENGTH}


def _defaults(record: type) -> dict[str, Any]:
    hints = typing.get_type_hints(record)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        kind = hints[f.name]
        if f.name in WORDS:
            out[f.name] = WORDS[f.name]
        elif type(None) in typing.get_args(kind):
            out[f.name] = None
        else:
            out[f.name] = {int: 0, float: 0.0, str: ""}[kind]
    return out


def iteration(**given: Any) -> IterationStats:
    """An IterationStats with `given` fields, the rest zero."""
    return IterationStats(**{**_defaults(IterationStats), **given})


def request(**given: Any) -> RequestStats:
    """A RequestStats with `given` fields, the rest zero/None ("api" source, "length" finish)."""
    return RequestStats(**{**_defaults(RequestStats), **given})
