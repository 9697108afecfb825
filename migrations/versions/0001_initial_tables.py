"""Initial tables: iterations, their 1 s rollups, requests, knob changes, runs, run requests,
telemetry drops.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the rolled-up iteration columns as of this revision.
_ROLLUP_COLUMNS = (
    "duration_s",
    "running",
    "waiting",
    "prefill_seqs",
    "prefill_tokens",
    "decode_seqs",
    "decode_tokens",
    "scheduled_tokens",
    "padding_tokens",
    "token_budget",
    "max_num_seqs",
    "kv_blocks_used",
    "kv_blocks_free",
    "kv_blocks_total",
    "preemptions",
    "finished",
    "knob_version",
)
_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _id() -> sa.Column:
    return sa.Column("id", _BIG_ID, primary_key=True, autoincrement=True)


def upgrade() -> None:
    op.create_table(
        "iterations",
        _id(),
        sa.Column("replica_id", sa.String(64), nullable=False),
        sa.Column("iteration", sa.BigInteger(), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("duration_s", sa.Double(), nullable=False),
        *[
            sa.Column(name, sa.Integer(), nullable=False)
            for name in (
                "running",
                "waiting",
                "prefill_seqs",
                "prefill_tokens",
                "decode_seqs",
                "decode_tokens",
                "scheduled_tokens",
                "padding_tokens",
                "token_budget",
                "max_num_seqs",
                "kv_blocks_used",
                "kv_blocks_free",
                "kv_blocks_total",
                "preemptions",
                "finished",
                "knob_version",
            )
        ],
        sa.Column("policy", sa.String(32), nullable=False),
    )
    op.create_table(
        "iteration_rollups",
        sa.Column("replica_id", sa.String(64), primary_key=True),
        sa.Column("second", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("n", sa.Integer(), nullable=False),
        *[
            sa.Column(f"{name}_{stat}", sa.Double(), nullable=False)
            for name in _ROLLUP_COLUMNS
            for stat in ("min", "max", "sum")
        ],
    )
    op.create_table(
        "requests",
        _id(),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("replica_id", sa.String(64), nullable=False),
        sa.Column("run_id", sa.String(36), nullable=True),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("arrival", sa.Double(), nullable=False),
        sa.Column("first_scheduled", sa.Double(), nullable=True),
        sa.Column("first_token", sa.Double(), nullable=True),
        sa.Column("finished", sa.Double(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(16), nullable=False),
        sa.Column("preemptions", sa.Integer(), nullable=False),
    )
    op.create_table(
        "knob_changes",
        _id(),
        sa.Column("replica_id", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("iteration", sa.BigInteger(), nullable=False),
        sa.Column("applied_at", sa.Double(), nullable=False),
        sa.Column("old", sa.JSON(), nullable=False),
        sa.Column("new", sa.JSON(), nullable=False),
        sa.Column("source", sa.String(32), nullable=False),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("replica_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("workload", sa.String(200), nullable=False),
        sa.Column("arrival", sa.JSON(), nullable=False),
        sa.Column("knobs", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("ended_at", sa.Double(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=True),
    )
    op.create_table(
        "run_requests",
        _id(),
        sa.Column(
            "run_id",
            sa.String(36),
            sa.ForeignKey("runs.id", ondelete="CASCADE", name="fk_run_requests_run_id_runs"),
            nullable=False,
        ),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(128), nullable=True),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("error_kind", sa.String(64), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("output_tokens", sa.Integer(), nullable=True),
        sa.Column("requested_output_tokens", sa.Integer(), nullable=True),
        sa.Column("ttft_s", sa.Double(), nullable=True),
        sa.Column("e2e_s", sa.Double(), nullable=True),
        sa.Column("tpot_s", sa.Double(), nullable=True),
        sa.Column("itl_s", sa.JSON(), nullable=True),
        sa.Column("itl_mean_s", sa.Double(), nullable=True),
        sa.Column("itl_p50_s", sa.Double(), nullable=True),
        sa.Column("itl_p99_s", sa.Double(), nullable=True),
        sa.Column("start_offset_s", sa.Double(), nullable=True),
        sa.UniqueConstraint("run_id", "index", name="uq_run_requests_run_index"),
    )
    op.create_table(
        "telemetry_drops",
        _id(),
        sa.Column("replica_id", sa.String(64), nullable=False),
        sa.Column("at", sa.Double(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
    )


def downgrade() -> None:
    for table in (
        "telemetry_drops",
        "run_requests",
        "runs",
        "knob_changes",
        "requests",
        "iteration_rollups",
        "iterations",
    ):
        op.drop_table(table)
