"""A window of a running replica's own traffic ("the last N minutes") as a run to replay.

The requests are the replica's server-side records that arrived in the window; the iterations
are the replica's since the running engine started (earlier ones may come from another engine
configuration); the knobs are those in force when the window began. What was measured is the
server-side view (TTFT and E2E from arrival; no per-token times, so no ITL).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select

from appliance.bench.metrics import RequestResult, summarize
from appliance.engine.knobs import Knobs
from appliance.sim.fit import MIN_ROWS, EngineKey
from appliance.sim.records import RecordedRun, iteration_rows
from appliance.sim.replay import CacheShape, SimRequest
from appliance.telemetry.models import Request
from appliance.telemetry.store import using_engine

COMPLETED = ("stop", "length")


class NoMatchingIterations(ValueError):
    """Too few iterations of the running configuration to fit a step-time model on."""


def knobs_at(current: Knobs, history: Sequence[Mapping[str, Any]], when: float) -> Knobs:
    """The knobs in force at `when`: `current` with every change applied after it undone
    (`history` holds KnobChange.as_dict() entries, oldest first)."""
    values = current.as_dict()
    for change in reversed(history):
        if change["applied_at"] > when:
            values.update(change["old"])
    return Knobs(**values)


def load_window(target: Any, replica_id: str, since: float, until: float, *, knobs: Knobs,
                fixed: Mapping[str, Any], engine_started: float, knob_changes: int) -> RecordedRun:
    """The replica's traffic of [since, until] as a RecordedRun (its `summary` is the server-side
    measurement); NoMatchingIterations when the running engine recorded too few iterations in it,
    ValueError when no request arrived in it."""
    key = EngineKey.from_fixed(fixed)
    iterations = iteration_rows(target, replica_id, max(since, engine_started), until)
    if len(iterations) < MIN_ROWS:
        raise NoMatchingIterations(
            f"only {len(iterations)} iteration(s) of the running configuration ({key}) in the last "
            f"{(until - since) / 60:g} minutes; at least {MIN_ROWS} are needed to predict anything: "
            "send some traffic first, or pick a recorded run")
    rq = Request.__table__
    query = (select(rq).where(rq.c.replica_id == replica_id, rq.c.arrival >= since, rq.c.arrival <= until)
             .order_by(rq.c.arrival, rq.c.id))
    with using_engine(target) as engine, engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(query)]
    requests, results = [], []
    for r in rows:
        cancelled = r["finish_reason"] == "abort"
        if r["output_tokens"] < 1 and not cancelled:
            continue  # an error before any output: nothing to replay
        requests.append(SimRequest(arrival=r["arrival"] - since, prompt_tokens=r["prompt_tokens"],
                                   output_tokens=max(1, r["output_tokens"] + (1 if cancelled else 0)),
                                   cancel_at=r["finished"] - since if cancelled else None,
                                   cached_tokens=r["cached_tokens"]))
        ok = r["finish_reason"] in COMPLETED
        results.append(RequestResult(
            index=len(results), sent_at=r["arrival"], ok=ok, error_kind=None if ok else "aborted",
            ttft=None if r["first_token"] is None else r["first_token"] - r["arrival"],
            e2e=r["finished"] - r["arrival"], prompt_tokens=r["prompt_tokens"], output_tokens=r["output_tokens"],
            finish_reason=r["finish_reason"], server_request_id=r["request_id"]))
    if not requests:
        raise ValueError(f"no request arrived at replica {replica_id!r} in the last {(until - since) / 60:g} minutes")
    cache = CacheShape(int(fixed["num_blocks"]), int(fixed["block_size"]), int(fixed["max_model_len"]))
    # throughput over the same span the replay measures: from the window's start to the last finish
    duration = max(r["finished"] for r in rows) - since
    summary = summarize(results, max(duration, 1e-9), len(results)).as_dict()
    return RecordedRun(run_id="", name=f"last {(until - since) / 60:g} min", replica_id=replica_id, started_at=since,
                       ended_at=until, arrival={"mode": "recorded"}, knobs=knobs, cache=cache, key=key,
                       requests=requests, iterations=iterations, knob_changes=knob_changes,
                       summary={"summary": summary})
