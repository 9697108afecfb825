"""A fleet's size over time: one row each time the number of live replicas changes.

Revision ID: 0007_fleet_sizes
Revises: 0006_knob_reasons
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_fleet_sizes"
down_revision: str | None = "0006_knob_reasons"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "fleet_sizes",
        sa.Column("id", BIG_ID, primary_key=True, autoincrement=True),
        sa.Column("fleet_id", sa.String(64), nullable=False),
        sa.Column("at", sa.Double(), nullable=False),
        sa.Column("replicas", sa.Integer(), nullable=False),
    )
    op.create_index("ix_fleet_sizes_fleet_at", "fleet_sizes", ["fleet_id", "at"])


def downgrade() -> None:
    op.drop_index("ix_fleet_sizes_fleet_at", table_name="fleet_sizes")
    op.drop_table("fleet_sizes")
