"""Indexes for time-window queries over millions of rows.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INDEXES = (
    ("ix_iterations_replica_started", "iterations", ["replica_id", "started_at"]),
    ("ix_iterations_started", "iterations", ["started_at"]),
    ("ix_iteration_rollups_second", "iteration_rollups", ["second"]),
    ("ix_requests_replica_finished", "requests", ["replica_id", "finished"]),
    ("ix_requests_finished", "requests", ["finished"]),
    ("ix_requests_run", "requests", ["run_id"]),
    ("ix_requests_request_id", "requests", ["request_id"]),
    ("ix_knob_changes_replica_applied", "knob_changes", ["replica_id", "applied_at"]),
    ("ix_runs_replica_started", "runs", ["replica_id", "started_at"]),
    ("ix_runs_status", "runs", ["status"]),
    ("ix_telemetry_drops_replica_at", "telemetry_drops", ["replica_id", "at"]),
)


def upgrade() -> None:
    for name, table, columns in _INDEXES:
        op.create_index(name, table, columns)


def downgrade() -> None:
    for name, table, _columns in reversed(_INDEXES):
        op.drop_index(name, table_name=table)
