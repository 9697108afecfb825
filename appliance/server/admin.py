"""Operator routes: live knobs, their history, and the engine's state."""

from __future__ import annotations

import asyncio
import re

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from ..engine import KnobError
from ..engine.validation import problems
from ..wire import REASON_HEADER, SOURCE_HEADER
from .autopilot_policy import SpecError, parse_spec
from .errors import APIError, JSONResponse, ServerErrorCode
from .protocol import parse_json, read_body
from .state import AppState

MAX_REASON_CHARS = 500
_SOURCE_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}")
KNOB_UPDATE_TIMEOUT_S = 30.0


class AutopilotPatch(BaseModel):
    """The body of PATCH /admin/autopilot: switch it, give it targets and bounds, or both."""

    model_config = ConfigDict(extra="forbid", strict=True)

    enabled: bool | None = Field(None, description="switch the autopilot on or off")
    spec: str | dict[str, Any] | None = Field(
        None, description='SLO targets and knob bounds: "ttft_p99=1s,itl_p99=150ms,max_num_seqs=8..128", or '
                          '{"targets": {"ttft_p99": 1.0}, "bounds": {"max_num_seqs": [8, 128]}}')


def _state(request: Request) -> AppState:
    return request.app.state.appliance


async def knobs(request: Request) -> JSONResponse:
    """GET: the knobs in force; PATCH: change some (one route, so 405 lists both methods)."""
    if request.method == "PATCH":
        return await patch_knobs(request)
    return JSONResponse(_state(request).knobs_view())


def _knob_error(errors: dict[str, str]) -> APIError:
    message = "invalid knobs: " + "; ".join(f"{k}: {v}" for k, v in errors.items())
    return APIError(422, message, param=next(iter(errors), None), code=ServerErrorCode.INVALID_KNOBS,
                    extra={"errors": errors})


async def patch_knobs(request: Request) -> JSONResponse:
    """Send the change to the engine, which validates it whole (422 naming every bad field,
    nothing applied) and applies it at the next iteration boundary; answer once it took effect,
    with the knobs then in force, their version and the iteration they took effect at. The
    change is recorded with source "admin", or the X-Appliance-Source header's value (e.g.
    "dashboard"), and the X-Appliance-Reason header's text as its reason (none: null); a change
    that changes nothing adds no version."""
    state = _state(request)
    source = request.headers.get(SOURCE_HEADER, "admin").strip().lower()
    if not _SOURCE_RE.fullmatch(source):
        raise APIError(400, "X-Appliance-Source must be 1-32 characters of [a-z0-9_-], starting with a letter",
                       param="X-Appliance-Source")
    reason = request.headers.get(REASON_HEADER, "").strip() or None
    if reason is not None and len(reason) > MAX_REASON_CHARS:
        raise APIError(400, f"{REASON_HEADER} must be at most {MAX_REASON_CHARS} characters, got {len(reason)}",
                       param=REASON_HEADER)
    body = parse_json(await read_body(request, state.config.max_body_bytes))
    if not isinstance(body, dict):
        raise _knob_error({"body": "must be a JSON object mapping knob names to values"})
    if not state.aeng.is_running:
        raise APIError(503, "the engine is not running", code=ServerErrorCode.ENGINE_UNAVAILABLE)
    update = asyncio.ensure_future(state.aeng.update_knobs(body, source=source, reason=reason))
    try:
        # shield: a cancelled handler must not cancel the future the engine thread will resolve
        change = await asyncio.wait_for(asyncio.shield(update), KNOB_UPDATE_TIMEOUT_S)
    except KnobError as exc:
        raise _knob_error(exc.errors) from None
    except asyncio.TimeoutError:
        raise APIError(503, "the engine did not apply the change in time",
                       code=ServerErrorCode.ENGINE_UNAVAILABLE) from None
    view = state.knobs_view()
    if change is not None:
        view.update(source=change.source, changed={"old": change.old, "new": change.new})
    return JSONResponse(view)


async def knob_history(request: Request) -> JSONResponse:
    history = _state(request).knob_snapshot().history
    return JSONResponse({"data": [change.as_dict() for change in history]})


async def engine_state(request: Request) -> JSONResponse:
    return JSONResponse(_state(request).state_view())


async def autopilot(request: Request) -> JSONResponse:
    """GET: the autopilot's switch, spec, status and recent moves (each with its reason).
    PATCH {"enabled": bool, "spec": "ttft_p99=1s,..." or {"targets": ..., "bounds": ...}}:
    validated as a whole (422 naming each bad field, nothing changed), then applied."""
    state = _state(request)
    if request.method == "PATCH":
        body = parse_json(await read_body(request, state.config.max_body_bytes))
        errors: dict[str, str] = {}
        try:
            patch = AutopilotPatch.model_validate(body)
        except ValidationError as exc:
            described = {name: f.description for name, f in AutopilotPatch.model_fields.items() if f.description}
            errors = {p.param: p.detail for p in problems(exc, descriptions=described)}
            patch = AutopilotPatch()
        enabled, spec = patch.enabled, None
        if patch.spec is not None:
            try:
                spec = parse_spec(patch.spec)
            except SpecError as exc:
                errors.update({f"spec.{k}": v for k, v in exc.errors.items()})
        if enabled and spec is None and state.autopilot.spec is None and "spec" not in errors:
            errors["spec"] = "targets are required to switch the autopilot on"
        if errors:
            message = "invalid autopilot settings: " + "; ".join(f"{k}: {v}" for k, v in errors.items())
            raise APIError(422, message, param=next(iter(errors)), code=ServerErrorCode.INVALID_AUTOPILOT, extra={"errors": errors})
        state.autopilot.configure(enabled, spec)
    return JSONResponse(state.autopilot.view())
