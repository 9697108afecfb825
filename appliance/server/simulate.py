"""POST /admin/simulate: what a knob change would do, replayed on this server's own traffic.

    {"run_id": "RUN_ID" | "last_minutes": 10, "knobs": {"max_num_seqs": 16, ...}}

replays a recorded run (or this replica's requests of the last N minutes) at the knobs it ran
with and at those knobs with `knobs` on top, through the engine's own scheduler on a virtual
clock (appliance.sim), and answers both with what was measured (its summary and the recorded
iterations' timeline), the step-time model's held-out error and the window it was fitted on.
Only iterations of the running configuration are used: a run recorded on another engine
configuration, or a window with too few iterations since this engine started, is answered 422
"no_matching_iterations" instead of a guess. Nothing is applied
(PATCH /admin/knobs does that). The replay runs in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from starlette.requests import Request

from ..engine import KnobError, Knobs
from ..engine.validation import RequestErrorCode
from .errors import APIError, JSONResponse, ServerErrorCode, bad_request
from .protocol import parse, parse_json, read_body
from .state import AppState

MAX_WINDOW_MINUTES = 60.0  # a longer window replays more traffic than an interactive answer allows


class SimulateRequest(BaseModel):
    """The body of POST /admin/simulate: exactly one of `last_minutes` and `run_id`, and knobs."""

    model_config = ConfigDict(extra="forbid", strict=True)

    last_minutes: float | None = Field(None, gt=0, le=MAX_WINDOW_MINUTES, allow_inf_nan=False,
                                       description="this replica's traffic of the last N minutes")
    run_id: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)] | None = Field(
        None, validate_default=True, description="a recorded run")
    knobs: dict[str, Any] = Field(default_factory=dict, description="the knobs to predict, on top of the source's")

    @field_validator("run_id")
    @classmethod
    def _one_source(cls, run_id: str | None, info: ValidationInfo) -> str | None:
        if "last_minutes" in info.data and (run_id is None) == (info.data["last_minutes"] is None):
            raise PydanticCustomError(RequestErrorCode.INVALID_VALUE.value, "give exactly one of run_id (a recorded "
                                      "run) and last_minutes (this replica's recent traffic)")
        return run_id


@dataclass(frozen=True)
class Running:
    """What the running engine is: its knobs (and their history), fixed settings, start time."""

    replica_id: str
    knobs: Knobs
    fixed: dict[str, Any]
    history: list[dict[str, Any]]
    started_at: float


def parse_query(body: Any) -> SimulateRequest:
    """Validate the request body; APIError 400 naming the bad field (422-free: nothing runs)."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object: {\"run_id\" or \"last_minutes\", \"knobs\"}", param="body")
    query = parse(SimulateRequest, body)
    names = Knobs.names()
    errors = {k: "unknown knob" + (" (fixed at start)" if k == "num_blocks" else "") for k in query.knobs
              if k not in names}
    if errors:
        raise knob_error(errors)
    return query


def knob_error(errors: dict[str, str]) -> APIError:
    message = "invalid knobs: " + "; ".join(f"{k}: {v}" for k, v in errors.items())
    return APIError(400, message, param=next(iter(errors), None), code=ServerErrorCode.INVALID_KNOBS,
                    extra={"errors": errors})


class NoMatch(Exception):
    """Nothing of the running configuration to predict from (answered 422)."""


def answer(db_url: str, query: SimulateRequest, running: Running) -> dict[str, Any]:
    """The simulation report (blocking: replays in the calling thread). Raises LookupError
    (unknown run), KnobError, NoMatch, or ValueError (the run cannot be replayed)."""
    from appliance.sim import whatif
    from appliance.sim.cli import model_view, outcome_view, run_view, timeline
    from appliance.sim.fit import EngineKey
    from appliance.sim.records import load_run
    from appliance.sim.replay import check_fits
    from appliance.sim.window import NoMatchingIterations, knobs_at, load_window

    started = time.perf_counter()
    key = EngineKey.from_fixed(running.fixed)
    if query.run_id is not None:
        run = load_run(db_url, query.run_id)
        if run.key != key:
            raise NoMatch(f"run {run.run_id} was recorded on {run.key}; the running engine is {key}: none of its "
                          "iterations match the running configuration, so there is nothing to predict from "
                          "(pick a run recorded on this engine, or the last N minutes)")
    else:
        assert query.last_minutes is not None
        until = time.time()
        since = until - query.last_minutes * 60
        changes = sum(1 for c in running.history if since < c["applied_at"] <= until)
        try:
            run = load_window(db_url, running.replica_id, since, until,
                              knobs=knobs_at(running.knobs, running.history, since), fixed=running.fixed,
                              engine_started=running.started_at, knob_changes=changes)
        except NoMatchingIterations as exc:
            raise NoMatch(str(exc)) from None
    proposed = whatif.scenario(run.knobs, run.cache, query.knobs)  # KnobError before anything is fitted or stored
    check_fits(run.requests, proposed.cache)
    model = whatif.fit_for_run(db_url, run)  # a stored run's model is reused, a window's fitted anew
    concurrency = whatif.run_concurrency(run)
    baseline, predicted = whatif.what_if(run, model, [(dict(query.knobs), proposed)], slo=None,
                                         requests=run.requests, concurrency=concurrency)
    return {
        "object": "simulation",
        "source": {**run_view(run), "kind": "run" if query.run_id else "window", "since": run.started_at,
                   "until": run.ended_at},
        "running_engine": str(key),
        "model": model_view(model),
        "recorded": (run.summary or {}).get("summary"),
        "recorded_timeline": timeline(run.iterations),
        "recorded_by": "client" if query.run_id else "server",
        "baseline": outcome_view(baseline),
        "predicted": outcome_view(predicted),
        "knobs": proposed.knobs.as_dict(),
        "elapsed_s": time.perf_counter() - started,
    }


async def simulate(request: Request) -> JSONResponse:
    """POST /admin/simulate (see the module docstring)."""
    state: AppState = request.app.state.appliance
    query = parse_query(parse_json(await read_body(request, state.config.max_body_bytes)))
    if state.config.db_url is None:
        raise APIError(409, "this server runs without a telemetry store (--no-telemetry): nothing to simulate from",
                       code=ServerErrorCode.NO_TELEMETRY_STORE)
    knobs = state.knob_snapshot()
    running = Running(state.config.replica_id, knobs.knobs, state.fixed(), [c.as_dict() for c in knobs.history],
                      state.aeng.started_at)
    param = "run_id" if query.run_id is not None else "last_minutes"
    try:
        report = await asyncio.to_thread(answer, state.config.db_url, query, running)
    except KnobError as exc:
        raise knob_error(exc.errors) from None
    except LookupError as exc:
        raise bad_request(str(exc), param=param, code=ServerErrorCode.RUN_NOT_FOUND) from None
    except NoMatch as exc:
        raise APIError(422, str(exc), param=param, code=ServerErrorCode.NO_MATCHING_ITERATIONS) from None
    except ValueError as exc:  # FitError, ReplayError: the run cannot be replayed
        raise bad_request(str(exc), param=param) from None
    return JSONResponse(report)
