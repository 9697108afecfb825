"""Why each knob change was made: its reason (text; the autopilot always gives one, a person
may) and, for the autopilot's moves, the prediction behind it (JSON).

Revision ID: 0006_knob_reasons
Revises: 0005_prefix_cache
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_knob_reasons"
down_revision: str | None = "0005_prefix_cache"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # rows already stored read NULL: no reason was recorded then
    with op.batch_alter_table("knob_changes") as batch:
        batch.add_column(sa.Column("reason", sa.Text(), nullable=True))
        batch.add_column(sa.Column("prediction", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("knob_changes") as batch:
        batch.drop_column("prediction")
        batch.drop_column("reason")
