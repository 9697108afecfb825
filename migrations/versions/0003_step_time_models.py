"""Step-time models for the what-if simulator, and the decode rows' attended context per iteration.

Revision ID: 0003_step_time_models
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_step_time_models"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("iterations", sa.Column("decode_context_tokens", sa.Integer(), nullable=True))
    op.create_table(
        "step_time_models",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("dtype", sa.String(32), nullable=False),
        sa.Column("device", sa.String(64), nullable=False),
        sa.Column("cpu_kernels", sa.Boolean(), nullable=True),
        sa.Column("threads", sa.Integer(), nullable=True),
        sa.Column("replica_id", sa.String(64), nullable=False),
        sa.Column("run_id", sa.String(36), nullable=True),
        sa.Column("window_start", sa.Double(), nullable=False),
        sa.Column("window_end", sa.Double(), nullable=False),
        sa.Column("method", sa.String(32), nullable=False),
        sa.Column("coefficients", sa.JSON(), nullable=False),
        sa.Column("gap_s", sa.Double(), nullable=False),
        sa.Column("rows_used", sa.Integer(), nullable=False),
        sa.Column("rows_held_out", sa.Integer(), nullable=False),
        sa.Column("heldout_mape", sa.Double(), nullable=False),
        sa.Column("heldout_mae_s", sa.Double(), nullable=False),
        sa.Column("fitted_at", sa.Double(), nullable=False),
    )
    op.create_index("ix_step_time_models_key", "step_time_models", ["model", "dtype", "device", "fitted_at"])


def downgrade() -> None:
    op.drop_index("ix_step_time_models_key", table_name="step_time_models")
    op.drop_table("step_time_models")
    with op.batch_alter_table("iterations") as batch:
        batch.drop_column("decode_context_tokens")
