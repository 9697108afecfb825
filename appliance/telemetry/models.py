"""SQLAlchemy models of the telemetry store. The schema itself is owned by the Alembic
migrations in the top-level `migrations/` folder; these models must match their head
(tests/test_telemetry_migrations.py checks it). The columns of `iterations` and `requests`, and
the rolled-up columns, come from the engine records' declarations (appliance.records).

Times are wall-clock seconds since the epoch (float), as the engine records them.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Double,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from appliance.metrics_spec import Metric
from appliance.records import ITERATION_METRICS, REQUEST_METRICS

# Numeric iteration columns that can be charted (and that the 1 s rollup aggregates).
SERIES_COLUMNS: tuple[str, ...] = tuple(m.name for m in ITERATION_METRICS if m.rollup)
ROLLUP_STATS: tuple[str, ...] = ("min", "max", "sum")

# BIGINT on PostgreSQL, INTEGER (the rowid alias) on SQLite so autoincrement works there.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[float]: JSON}


def metric_columns(metrics: tuple[Metric, ...]) -> list[Column]:
    """The columns of an engine record's fields, as their Metric declarations describe them."""
    return [Column(m.name, _sql_type(m), nullable=m.nullable) for m in metrics]


def _record_table(name: str, metrics: tuple[Metric, ...], *indexes: Index) -> Table:
    """The table of one kind of engine record: an id, the writer's replica_id, its fields."""
    return Table(
        name,
        Base.metadata,
        Column("id", BigId, primary_key=True, autoincrement=True),
        Column("replica_id", String(64), nullable=False),
        *metric_columns(metrics),
        *indexes,
    )


def _sql_type(m: Metric) -> Any:
    if m.type is float:
        return Double()
    if m.type is int:
        return BigInteger() if m.wide else Integer()
    return String(m.max_length)


class Iteration(Base):
    """One engine iteration (IterationStats + replica_id)."""

    __table__ = _record_table(
        "iterations",
        ITERATION_METRICS,
        Index("ix_iterations_replica_started", "replica_id", "started_at"),
        Index("ix_iterations_started", "started_at"),
    )


# Per-replica, per-second aggregates of the iteration rows (n, and min/max/sum of every
# SERIES_COLUMNS column), rebuilt by the writer in the same transaction as the rows. Long
# windows are downsampled from here, so a one-hour chart reads 3,600 rows, not millions.
iteration_rollups = Table(
    "iteration_rollups",
    Base.metadata,
    Column("replica_id", String(64), primary_key=True),
    Column("second", BigInteger, primary_key=True, autoincrement=False),
    Column("n", Integer, nullable=False),
    *[Column(f"{name}_{stat}", Double, nullable=False) for name in SERIES_COLUMNS for stat in ROLLUP_STATS],
    Index("ix_iteration_rollups_second", "second"),
)


class Request(Base):
    """One finished request as the server saw it (RequestStats + replica_id)."""

    __table__ = _record_table(
        "requests",
        REQUEST_METRICS,
        Index("ix_requests_replica_finished", "replica_id", "finished"),
        Index("ix_requests_finished", "finished"),
        Index("ix_requests_run", "run_id"),
        Index("ix_requests_request_id", "request_id"),
    )


class KnobChangeRow(Base):
    """One applied knob change."""

    __tablename__ = "knob_changes"
    __table_args__ = (Index("ix_knob_changes_replica_applied", "replica_id", "applied_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    replica_id: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(Integer)
    iteration: Mapped[int] = mapped_column(BigInteger)  # first iteration with the new values
    applied_at: Mapped[float] = mapped_column(Double)
    old: Mapped[dict[str, Any]]
    new: Mapped[dict[str, Any]]
    source: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str | None] = mapped_column(Text)  # why (the autopilot always says; a person may)
    prediction: Mapped[dict[str, Any] | None]  # the autopilot's predicted figures before/after


class Run(Base):
    """One load test or tuning sweep."""

    __tablename__ = "runs"
    __table_args__ = (
        Index("ix_runs_replica_started", "replica_id", "started_at"),
        Index("ix_runs_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)  # uuid4 string
    replica_id: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(200))
    workload: Mapped[str] = mapped_column(String(200))
    arrival: Mapped[dict[str, Any]]
    knobs: Mapped[dict[str, Any]]
    started_at: Mapped[float] = mapped_column(Double)
    ended_at: Mapped[float | None] = mapped_column(Double)
    status: Mapped[str] = mapped_column(String(16))  # a RunStatus
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class RunRequest(Base):
    """Client-side result of one request of a run."""

    __tablename__ = "run_requests"
    __table_args__ = (UniqueConstraint("run_id", "index", name="uq_run_requests_run_index"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(
        String(36), ForeignKey("runs.id", ondelete="CASCADE", name="fk_run_requests_run_id_runs")
    )
    index: Mapped[int] = mapped_column(Integer)
    request_id: Mapped[str | None] = mapped_column(String(128))  # as the server named it
    ok: Mapped[bool] = mapped_column(Boolean)
    error_kind: Mapped[str | None] = mapped_column(String(64))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    requested_output_tokens: Mapped[int | None] = mapped_column(Integer)
    ttft_s: Mapped[float | None] = mapped_column(Double)
    e2e_s: Mapped[float | None] = mapped_column(Double)
    tpot_s: Mapped[float | None] = mapped_column(Double)
    itl_s: Mapped[list[float] | None] = mapped_column(JSON)
    itl_mean_s: Mapped[float | None] = mapped_column(Double)
    itl_p50_s: Mapped[float | None] = mapped_column(Double)
    itl_p99_s: Mapped[float | None] = mapped_column(Double)
    start_offset_s: Mapped[float | None] = mapped_column(Double)  # send time from run start


class TelemetryDrop(Base):
    """Rows the writer had to drop (buffer overflow or a store it could not write)."""

    __tablename__ = "telemetry_drops"
    __table_args__ = (Index("ix_telemetry_drops_replica_at", "replica_id", "at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    replica_id: Mapped[str] = mapped_column(String(64))
    at: Mapped[float] = mapped_column(Double)
    count: Mapped[int] = mapped_column(Integer)


class FleetSize(Base):
    """A fleet's size when it changed: how many replicas served from `at` on (recorded by the
    fleet's ingress; a single process records none)."""

    __tablename__ = "fleet_sizes"
    __table_args__ = (Index("ix_fleet_sizes_fleet_at", "fleet_id", "at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    fleet_id: Mapped[str] = mapped_column(String(64))
    at: Mapped[float] = mapped_column(Double)
    replicas: Mapped[int] = mapped_column(Integer)


class StepTimeModelRow(Base):
    """One fitted step-time model (appliance.sim.fit): seconds per iteration as a linear function
    of the iteration's composition, for one engine configuration (the key), fitted on the
    iterations of one replica in [window_start, window_end]."""

    __tablename__ = "step_time_models"
    __table_args__ = (Index("ix_step_time_models_key", "model", "dtype", "device", "fitted_at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String(200))
    dtype: Mapped[str] = mapped_column(String(32))
    device: Mapped[str] = mapped_column(String(64))
    cpu_kernels: Mapped[bool | None] = mapped_column(Boolean)  # None: not recorded
    threads: Mapped[int | None] = mapped_column(Integer)  # None: not recorded
    replica_id: Mapped[str] = mapped_column(String(64))
    run_id: Mapped[str | None] = mapped_column(String(36))  # fitted on a run's window, if so
    window_start: Mapped[float] = mapped_column(Double)
    window_end: Mapped[float] = mapped_column(Double)
    method: Mapped[str] = mapped_column(String(32))
    coefficients: Mapped[dict[str, Any]]  # feature name (and "intercept") -> seconds per unit
    gap_s: Mapped[float] = mapped_column(Double)  # engine-loop time between back-to-back iterations
    rows_used: Mapped[int] = mapped_column(Integer)
    rows_held_out: Mapped[int] = mapped_column(Integer)
    heldout_mape: Mapped[float] = mapped_column(Double)  # mean absolute percentage error, 0..1
    heldout_mae_s: Mapped[float] = mapped_column(Double)
    fitted_at: Mapped[float] = mapped_column(Double)
    noise: Mapped[list[float] | None]  # recorded / predicted seconds at percentiles 0..100; None: none
