"""What the simulator reads from and keeps in the telemetry store: a recorded run (its knobs,
cache, engine key, requests and iterations), iteration windows, and fitted step-time models."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.engine import Connection, Engine

from appliance.engine.knobs import KnobError, Knobs
from appliance.sim.fit import FEATURES, INTERCEPT, EngineKey, StepTimeModel
from appliance.sim.replay import CacheShape, SimRequest
from appliance.telemetry.models import Iteration, KnobChangeRow, Request, Run, RunRequest, StepTimeModelRow
from appliance.telemetry.store import using_engine


@dataclass
class RecordedRun:
    """A stored run as the simulator needs it. Request arrivals and cancellations are seconds
    from the run's start (sorted by arrival); iterations are raw `iterations` rows in time order."""

    run_id: str
    name: str
    replica_id: str
    started_at: float
    ended_at: float
    arrival: dict[str, Any]  # the load generator's arrival settings (mode, rate, concurrency...)
    knobs: Knobs  # in force when the run started
    cache: CacheShape
    key: EngineKey
    requests: list[SimRequest]
    iterations: list[dict[str, Any]]
    knob_changes: int  # changes applied during the run (a replay uses the starting knobs)
    summary: dict[str, Any] | None  # the stored bench summary (what was measured)


def load_run(target: Engine | str, run_id: str) -> RecordedRun:
    """Read a run; LookupError for an unknown id, ValueError when it lacks what a replay needs."""
    with using_engine(target) as engine, engine.connect() as conn:
        row = conn.execute(select(Run.__table__).where(Run.__table__.c.id == run_id)).first()
        if row is None:
            raise LookupError(f"no run {run_id!r} in the store")
        run = dict(row._mapping)
        payload = run["knobs"] or {}
        fixed = payload.get("fixed") or {}
        if not payload.get("knobs") or not fixed.get("num_blocks"):
            raise ValueError(f"run {run_id!r} has no recorded engine settings (was it run against the appliance?)")
        try:
            knobs = Knobs(**payload["knobs"])
        except (KnobError, TypeError) as exc:
            raise ValueError(f"run {run_id!r}: its recorded knobs are not valid here: {exc}") from None
        started = float(run["started_at"])
        requests, last_finish = _run_requests(conn, run_id, started)
        if not requests:
            raise ValueError(f"run {run_id!r} has no server-side request records to replay")
        ended = float(run["ended_at"]) if run["ended_at"] is not None else started + last_finish
        iterations = iteration_rows(conn, run["replica_id"], started, ended)
        kc = KnobChangeRow.__table__
        changes = conn.execute(select(kc.c.id).where(kc.c.replica_id == run["replica_id"], kc.c.applied_at > started,
                                                     kc.c.applied_at <= ended)).all()
    cache = CacheShape(int(fixed["num_blocks"]), int(fixed["block_size"]), int(fixed["max_model_len"]))
    return RecordedRun(run_id, run["name"], run["replica_id"], started, ended, dict(run["arrival"] or {}), knobs,
                       cache, EngineKey.from_fixed(fixed), requests, iterations, len(changes), run["summary"])


def _run_requests(conn: Connection, run_id: str, started: float) -> tuple[list[SimRequest], float]:
    """The run's requests as the server saw them, with lengths asked for by the client where an
    abort cut the output short."""
    rq, rr = Request.__table__, RunRequest.__table__
    asked = dict(conn.execute(select(rr.c.request_id, rr.c.requested_output_tokens)
                              .where(rr.c.run_id == run_id, rr.c.request_id.is_not(None))).all())
    out, last = [], 0.0
    for r in conn.execute(select(rq).where(rq.c.run_id == run_id).order_by(rq.c.arrival, rq.c.id)):
        cancelled = r.finish_reason == "abort"
        wanted = asked.get(r.request_id) or (r.output_tokens + 1 if cancelled else r.output_tokens)
        if r.output_tokens < 1 and not cancelled:
            continue  # an error before any output: nothing to replay
        out.append(SimRequest(arrival=max(0.0, r.arrival - started), prompt_tokens=r.prompt_tokens,
                              output_tokens=max(1, wanted), cancel_at=r.finished - started if cancelled else None,
                              cached_tokens=r.cached_tokens))
        last = max(last, r.finished - started)
    return out, last


def iteration_rows(target: Engine | Connection | str, replica_id: str, since: float, until: float) -> list[dict[str, Any]]:
    """Raw iteration rows of one replica that started within [since, until], in time order."""
    it = Iteration.__table__
    query = (select(it).where(it.c.replica_id == replica_id, it.c.started_at >= since, it.c.started_at <= until)
             .order_by(it.c.started_at, it.c.id))
    if isinstance(target, Connection):
        return [dict(r._mapping) for r in target.execute(query)]
    with using_engine(target) as engine, engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(query)]


def save_model(target: Engine | str, model: StepTimeModel) -> int:
    """Store a fitted model; returns (and sets) its row id."""
    values = {
        **{f: getattr(model.key, f) for f in ("model", "dtype", "device", "cpu_kernels", "threads")},
        "replica_id": model.replica_id, "run_id": model.run_id, "window_start": model.window_start,
        "window_end": model.window_end, "method": model.method, "coefficients": dict(model.coefficients),
        "gap_s": model.gap_s, "rows_used": model.rows_used, "rows_held_out": model.rows_held_out,
        "heldout_mape": model.heldout_mape, "heldout_mae_s": model.heldout_mae_s, "fitted_at": model.fitted_at,
        "noise": list(model.noise) or None,
    }
    with using_engine(target) as engine, engine.begin() as conn:
        model.id = int(conn.execute(insert(StepTimeModelRow.__table__).values(**values)).inserted_primary_key[0])
    return model.id


def latest_model(target: Engine | str, key: EngineKey, run_id: str | None = None) -> StepTimeModel | None:
    """The newest stored model for `key` (fitted on `run_id` when given), or None."""
    t = StepTimeModelRow.__table__
    query = select(t).where(t.c.model == key.model, t.c.dtype == key.dtype, t.c.device == key.device)
    query = query.where(t.c.cpu_kernels.is_(None) if key.cpu_kernels is None else t.c.cpu_kernels == key.cpu_kernels)
    query = query.where(t.c.threads.is_(None) if key.threads is None else t.c.threads == key.threads)
    if run_id is not None:
        query = query.where(t.c.run_id == run_id)
    with using_engine(target) as engine, engine.connect() as conn:
        row = conn.execute(query.order_by(t.c.fitted_at.desc(), t.c.id.desc()).limit(1)).first()
    return None if row is None else _model_of(row._mapping)


def _model_of(row: Mapping[str, Any]) -> StepTimeModel:
    key = EngineKey(row["model"], row["dtype"], row["device"], row["cpu_kernels"], row["threads"])
    coefficients = {name: float(row["coefficients"][name]) for name in (INTERCEPT, *FEATURES)}
    return StepTimeModel(key, coefficients, row["gap_s"], row["method"], row["rows_used"], row["rows_held_out"],
                         row["heldout_mape"], row["heldout_mae_s"], row["replica_id"], row["run_id"],
                         row["window_start"], row["window_end"], row["fitted_at"], row["id"],
                         tuple(row["noise"] or ()))
