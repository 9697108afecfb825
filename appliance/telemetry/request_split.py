"""Why a request was slow: its TTFT and decode time split over the iterations it lived through,
from the store's `requests` and `iterations` rows (same replica).

TTFT (first_token - arrival) = queueing + prefill compute + first-token sampling:
- queueing (arrival -> first_scheduled), by cause: each iteration the request waited through
  adds its overlap with the wait to the causes in that iteration's `held_by_*` counters, in
  their proportions (the counters say why the requests left waiting were held, not which one
  was held by what). "other" is the rest: the step already running when it arrived, the
  iteration that admitted it, and gaps between iterations.
- first-token sampling: from the end of the forward pass of the iteration that sampled the
  first token (its start + duration - sample_s) to first_token.
- prefill compute: the rest of first_scheduled -> first_token (its chunks and the iterations
  they rode in; a preemption before the first token also lands here).
Decode time (finished - first_token) = own steps + prefill stall: a step that also carried
prefill chunks costs its duration minus the request's typical step (the median of its steps
without prefill, else its shortest step); those extras are the stall chunked prefill bounds.
By construction the parts add up to the measured TTFT and E2E.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Engine

from appliance.records import HoldCause
from appliance.telemetry.models import Iteration, Request
from appliance.telemetry.store import using_engine

OTHER = "other"
SLOW_BY = ("e2e", "ttft", "queue")
_LOOKBACK_S = 600.0  # an iteration running when a request arrived started at most this long before
_ITERATION_COLUMNS = ("started_at", "duration_s", "sample_s", "running", "waiting", "prefill_tokens",
                      "decode_tokens", "kv_blocks_used", "kv_blocks_total",
                      *(cause.column for cause in HoldCause))


@dataclass(frozen=True)
class RequestSplit:
    """One request's times (seconds) and the iterations it lived through."""

    id: int  # the requests row
    request_id: str
    arrival: float
    finished: float
    ttft_s: float | None
    e2e_s: float
    queue_s: float
    queue_by_cause: dict[str, float]  # HoldCause values and OTHER; sums to queue_s
    prefill_s: float
    first_token_sampling_s: float
    decode_s: float | None
    decode_own_s: float | None
    decode_prefill_stall_s: float | None
    decode_steps: int
    decode_steps_with_prefill: int
    prompt_tokens: int
    output_tokens: int
    preemptions: int
    finish_reason: str
    iterations: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def slowest_requests(
    target: Engine | str,
    since: float | None = None,
    until: float | None = None,
    *,
    run_id: str | None = None,
    replica_id: str | None = None,
    by: str = "e2e",
    limit: int = 10,
) -> list[dict[str, Any]]:
    """The `limit` requests that finished in [since, until) (or belong to `run_id`) with the
    largest `by` ("e2e", "ttft" or "queue"), slowest first."""
    if by not in SLOW_BY:
        raise ValueError(f"by must be one of {', '.join(SLOW_BY)}, got {by!r}")
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    req = Request.__table__
    value = {"e2e": req.c.finished - req.c.arrival, "ttft": req.c.first_token - req.c.arrival,
             "queue": req.c.first_scheduled - req.c.arrival}[by]
    query = select(req.c.id, req.c.request_id, req.c.arrival, req.c.first_scheduled, req.c.first_token,
                   req.c.finished, req.c.prompt_tokens, req.c.output_tokens, req.c.preemptions,
                   req.c.finish_reason).where(value.is_not(None)).order_by(value.desc()).limit(limit)
    if since is not None:
        query = query.where(req.c.finished >= since)
    if until is not None:
        query = query.where(req.c.finished < until)
    if run_id is not None:
        query = query.where(req.c.run_id == run_id)
    if replica_id is not None:
        query = query.where(req.c.replica_id == replica_id)
    with using_engine(target) as engine, engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(query)]
    for r in rows:
        r["e2e_s"] = r["finished"] - r["arrival"]
        r["ttft_s"] = None if r["first_token"] is None else r["first_token"] - r["arrival"]
        r["queue_s"] = None if r["first_scheduled"] is None else r["first_scheduled"] - r["arrival"]
    return rows


def request_split(target: Engine | str, row_id: int) -> RequestSplit:
    """The split of the requests row `row_id` (LookupError if there is none)."""
    req, it = Request.__table__, Iteration.__table__
    with using_engine(target) as engine, engine.connect() as conn:
        row = conn.execute(select(req).where(req.c.id == row_id)).first()
        if row is None:
            raise LookupError(f"no request row {row_id}")
        r = row._mapping
        iterations = [dict(x._mapping) for x in conn.execute(
            select(*(it.c[c] for c in _ITERATION_COLUMNS))
            .where(it.c.replica_id == r["replica_id"], it.c.started_at >= r["arrival"] - _LOOKBACK_S,
                   it.c.started_at <= r["finished"])
            .order_by(it.c.started_at))]
    iterations = [x for x in iterations if x["started_at"] + x["duration_s"] > r["arrival"]]
    return split(dict(r), iterations)


def split(r: dict[str, Any], iterations: Sequence[dict[str, Any]]) -> RequestSplit:
    """The split of request row `r` over `iterations` (oldest first, those overlapping its life)."""
    arrival, finished = r["arrival"], r["finished"]
    scheduled, first = r["first_scheduled"], r["first_token"]
    queue_end = scheduled if scheduled is not None else finished
    by_cause = _queue_by_cause(arrival, queue_end, iterations)

    sampling = 0.0
    prefill_end = first if first is not None else finished
    if first is not None and scheduled is not None:
        sampler = [x for x in iterations if x["started_at"] <= first]
        if sampler:
            x = sampler[-1]
            forward_end = x["started_at"] + x["duration_s"] - x["sample_s"]
            sampling = min(max(0.0, first - forward_end), first - scheduled)
    prefill = (prefill_end - scheduled - sampling) if scheduled is not None else 0.0

    decode = own = stall = None
    steps: list[dict[str, Any]] = []
    with_prefill: list[dict[str, Any]] = []
    if first is not None:
        decode = finished - first
        steps = [x for x in iterations if first < x["started_at"] <= finished]
        with_prefill = [x for x in steps if x["prefill_tokens"] > 0]
        pure = [x["duration_s"] for x in steps if x["prefill_tokens"] == 0]
        typical = statistics.median(pure) if pure else min((x["duration_s"] for x in steps), default=0.0)
        stall = min(decode, sum(max(0.0, x["duration_s"] - typical) for x in with_prefill))
        own = decode - stall

    def phase(x: dict[str, Any]) -> str:
        if scheduled is None or x["started_at"] + x["duration_s"] <= scheduled:
            return "queue"
        return "prefill" if first is None or x["started_at"] <= first else "decode"

    return RequestSplit(
        id=r["id"], request_id=r["request_id"], arrival=arrival, finished=finished,
        ttft_s=None if first is None else first - arrival, e2e_s=finished - arrival,
        queue_s=queue_end - arrival, queue_by_cause=by_cause, prefill_s=prefill,
        first_token_sampling_s=sampling, decode_s=decode, decode_own_s=own, decode_prefill_stall_s=stall,
        decode_steps=len(steps), decode_steps_with_prefill=len(with_prefill),
        prompt_tokens=r["prompt_tokens"], output_tokens=r["output_tokens"], preemptions=r["preemptions"],
        finish_reason=str(r["finish_reason"]),
        iterations=[{**x, "phase": phase(x)} for x in iterations],
    )


def _queue_by_cause(start: float, end: float, iterations: Sequence[dict[str, Any]]) -> dict[str, float]:
    out = {str(cause): 0.0 for cause in HoldCause}
    attributed = 0.0
    for x in iterations:
        s, e = x["started_at"], x["started_at"] + x["duration_s"]
        overlap = min(e, end) - max(s, start)
        if overlap <= 0 or s < start or s <= end < e:
            continue  # the step running at arrival, or the one that admitted it: "other"
        held = {cause: x[cause.column] for cause in HoldCause}
        total = sum(held.values())
        if total <= 0:
            continue
        for cause, n in held.items():
            out[str(cause)] += overlap * n / total
        attributed += overlap
    out[OTHER] = (end - start) - attributed
    return out
