"""A step-time model's spread: recorded / predicted seconds at percentiles 0..100 of the
iterations it was fitted on (the replay draws each iteration's ratio from it).

Revision ID: 0008_step_time_noise
Revises: 0007_fleet_sizes
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_step_time_noise"
down_revision: str | None = "0007_fleet_sizes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # models stored before read NULL: replayed without spread, as they were fitted
    with op.batch_alter_table("step_time_models") as batch:
        batch.add_column(sa.Column("noise", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("step_time_models") as batch:
        batch.drop_column("noise")
