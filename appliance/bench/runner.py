"""One benchmark run end to end: send the workload, then keep the run in the telemetry store.

The run row is created when the first request is about to be sent (so the dashboard can show
it while it runs), the per-request results are added at the end, and the row is finished with
the summary. A store that fails after the load was sent never loses the results: the error is
kept on the returned `BenchmarkRun` instead.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.bench.loadgen import BenchError, LoadGenerator, LoadResult, RunStart
from appliance.bench.metrics import RequestResult, percentile
from appliance.records import RunStatus

STATUS_BY_STOP = {None: RunStatus.COMPLETED, "duration": RunStatus.COMPLETED, "cancelled": RunStatus.CANCELLED}
EXTERNAL_REPLICA = "external"  # replica id of runs against servers other than the appliance

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine


@dataclass
class BenchmarkRun:
    """A finished run: its identity, the load generator's result and where it was stored."""

    run_id: str
    name: str
    workload: str
    arrival: dict[str, Any]
    base_url: str
    load: LoadResult
    status: RunStatus  # COMPLETED or CANCELLED
    db_url: str | None = None
    storage_error: str | None = None

    def as_dict(self, with_requests: bool = False) -> dict[str, Any]:
        """JSON-ready description (per-request results only when asked)."""
        load = self.load
        out: dict[str, Any] = {
            "run_id": self.run_id,
            "name": self.name,
            "workload": self.workload,
            "arrival": self.arrival,
            "base_url": self.base_url,
            "model": load.model,
            "appliance_server": load.appliance_server,
            "replica_id": load.replica_id,
            "status": self.status,
            "stopped": load.stopped,
            "started_at": load.started_at,
            "finished_at": load.finished_at,
            "knobs": load.knobs,
            "knob_changes": load.knob_changes,
            "summary": load.summary.as_dict(),
            "db": self.db_url,
            "stored": self.db_url is not None and self.storage_error is None,
            "storage_error": self.storage_error,
        }
        if with_requests:
            out["requests"] = [r.as_dict() for r in load.results]
        return out


def new_run_id() -> str:
    return str(uuid.uuid4())


async def run_benchmark(
    generator: LoadGenerator,
    *,
    workload: str,
    name: str | None = None,
    db_url: str | None = None,
    run_id: str | None = None,
) -> BenchmarkRun:
    """Run `generator` under a new run id; store the run at `db_url` when given.

    Cancel with `generator.cancel()` (any thread). A store that cannot be opened when the run
    starts raises before any request is sent.
    """
    run_id = run_id or new_run_id()
    name = name or f"{workload} {describe_arrival(generator.arrival)}"
    store = RunStore(db_url) if db_url else None

    def started(start: RunStart) -> None:
        if store is not None:
            store.start(run_id, name, workload, generator.arrival, start)

    try:
        load = await generator.run(run_id, on_start=started)
    except BaseException as exc:
        if store is not None and store.started:
            store.fail(run_id, RunStatus.CANCELLED if isinstance(exc, asyncio.CancelledError) else RunStatus.FAILED)
        raise
    run = BenchmarkRun(run_id, name, workload, generator.arrival, generator.base_url, load,
                       STATUS_BY_STOP[load.stopped], db_url)
    if store is not None:
        try:
            store.finish(run)
        except Exception as exc:  # keep the results; report the store's failure
            run.storage_error = f"{type(exc).__name__}: {exc}"
    return run


def describe_arrival(arrival: dict[str, Any]) -> str:
    """Short text for LoadGenerator.arrival, e.g. "rate=2/s" or "concurrency=8"."""
    mode = arrival["mode"]
    if mode == "poisson":
        text = f"rate={arrival['rate']:g}/s"
    elif mode == "concurrency":
        text = f"concurrency={arrival['concurrency']}"
    else:
        text = mode
    if arrival.get("max_duration_s"):
        text += f" max {arrival['max_duration_s']:g}s"
    return text


def run_request_row(result: RequestResult, run_started_at: float) -> dict[str, Any]:
    """One client-side result as a telemetry `run_requests` row."""
    itl = result.itl
    return {
        "index": result.index,
        "ok": result.ok,
        "request_id": result.server_request_id,
        "error_kind": result.error_kind,
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": result.output_tokens,
        "requested_output_tokens": result.requested_output_len,
        "ttft_s": result.ttft,
        "e2e_s": result.e2e,
        "tpot_s": result.tpot,
        "itl_s": itl,
        "itl_mean_s": sum(itl) / len(itl) if itl else None,
        "itl_p50_s": percentile(itl, 50) if itl else None,
        "itl_p99_s": percentile(itl, 99) if itl else None,
        "start_offset_s": result.sent_at - run_started_at,
    }


class RunStore:
    """Keeps one run in the telemetry store (appliance.telemetry.runs), migrating it first."""

    def __init__(self, db_url: str):
        self.db_url = db_url
        self.engine: Engine | None = None
        self.started = False

    def start(self, run_id: str, name: str, workload: str, arrival: dict[str, Any],
              start: RunStart) -> None:
        """Create the run row ("running"); BenchError when the store cannot be used."""
        from appliance.telemetry import runs, store

        try:
            # Each write here reads the run row first; on SQLite a deferred transaction could
            # not then take the write lock once the server's writer committed in between
            # (SQLITE_BUSY without waiting), so take it at BEGIN and let the busy timeout wait.
            self.engine = store.make_engine(self.db_url).execution_options(sqlite_begin="IMMEDIATE")
            store.upgrade(self.engine)
            runs.create_run(self.engine, name, workload, arrival, start.knobs or {},
                            start.replica_id or EXTERNAL_REPLICA, run_id=run_id,
                            started_at=start.started_at)
        except Exception as exc:
            self.close()
            raise BenchError(f"cannot store the run in {self.db_url}: {type(exc).__name__}: {exc}") from exc
        self.started = True

    def finish(self, run: BenchmarkRun) -> None:
        """Add every request's result and close the run with its status and summary."""
        from appliance.telemetry import runs

        load = run.load
        try:
            runs.add_run_requests(self.engine, run.run_id,
                                  [run_request_row(r, load.started_at) for r in load.results])
            runs.finish_run(self.engine, run.run_id, run.status, run.as_dict(),
                            ended_at=load.finished_at)
        finally:
            self.close()

    def fail(self, run_id: str, status: RunStatus) -> None:
        """Close a run the generator did not finish (best effort: an error is on its way)."""
        from appliance.telemetry import runs

        try:
            runs.finish_run(self.engine, run_id, status)
        except Exception:  # the error that ended the run matters more than this one
            pass
        finally:
            self.close()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.dispose()
            self.engine = None
