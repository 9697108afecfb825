"""How a pydantic validation error reads: which parameter it names, a message, and a code.

One wording for every rule checked with pydantic, in the engine (sampling parameters, chat
messages, knobs) and in the server's request models; callers choose how a location in the
input maps to the parameter they report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Mapping

from pydantic import ValidationError


class RequestErrorCode(str, Enum):
    """Why a request was refused (the `code` of OpenAI's error object)."""

    INVALID_TYPE = "invalid_type"
    INVALID_VALUE = "invalid_value"
    MISSING = "missing_required_parameter"
    UNRECOGNIZED = "unrecognized_argument"
    UNSUPPORTED = "unsupported_parameter"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


Location = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    """One refused parameter: what to report as `param`, a message naming it, a code."""

    param: str
    message: str
    detail: str  # the message without the location
    code: RequestErrorCode


def show(value: Any) -> str:
    """A value as JSON, cut to 60 characters."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _where(loc: Location) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _code(kind: str) -> RequestErrorCode:
    if kind in {c.value for c in RequestErrorCode}:  # raised by our own validators
        return RequestErrorCode(kind)
    if kind == "missing":
        return RequestErrorCode.MISSING
    if kind == "extra_forbidden":
        return RequestErrorCode.UNRECOGNIZED
    if kind.endswith(("_type", "_parsing")) or kind == "int_from_float":
        return RequestErrorCode.INVALID_TYPE
    return RequestErrorCode.INVALID_VALUE


def problems(
    exc: ValidationError,
    param_of: Callable[[Location], str] = lambda loc: str(loc[0]) if loc else "body",
    descriptions: Mapping[str, str] | None = None,
    root: Location = (),
) -> list[Problem]:
    """One Problem per parameter, in pydantic's order. Several errors of one parameter (the
    branches of a union, several list items) read as one: "<param> must be <description>" when
    `descriptions` has one for it. `root` is put before every location (what was validated)."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for error in exc.errors(include_url=False):
        error["loc"] = (*root, *error["loc"])
        grouped.setdefault(param_of(error["loc"]), []).append(error)
    found = []
    for param, errors in grouped.items():
        first = errors[0]
        code = _code(first["type"])
        if code is RequestErrorCode.UNSUPPORTED:  # our own validator's sentence, complete as it is
            found.append(Problem(param, first["msg"], first["msg"], code))
            continue
        loc = _common_prefix([e["loc"] for e in errors])
        if len(errors) > 1 and descriptions and param in descriptions:
            loc = (param,)
            detail = f"must be {descriptions[param]}, got {show(first['input'])}"
        else:
            detail = "; ".join(_sentence(e["loc"][len(loc):], e) for e in errors)
        found.append(Problem(param, _join(_where(loc), detail), detail, code))
    return found


def _join(location: str, detail: str) -> str:
    """'prompt is required', 'prompt must be ...', 'top_p: input should be ...'."""
    if not location:
        return detail
    return f"{location} {detail}" if detail.startswith(("is ", "must ")) else f"{location}: {detail}"


def _sentence(loc: Location, error: dict[str, Any]) -> str:
    """'is required', 'input should be ..., got X', prefixed with `loc` when there is one."""
    if error["type"] == "missing":
        text = "is required"
    else:
        text = error["msg"][:1].lower() + error["msg"][1:]
        text += f", got {show(error['input'])}" if error["type"] != "too_long" else ""
    return _join(_where(loc), text)


def _common_prefix(locs: list[Location]) -> Location:
    prefix = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(prefix), len(loc)) and prefix[n] == loc[n]:
            n += 1
        prefix = prefix[:n]
    return tuple(prefix)

