"""Binding-cause counters per iteration: waiting requests held back by each limit and prefill
tokens deferred by the chunk size (appliance.records.HoldCause), and the time an iteration spent
after its forward pass (sample_s), raw and in the 1 s rollup.

Revision ID: 0004_binding_counters
Revises: 0003_step_time_models
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_binding_counters"
down_revision: str | None = "0003_step_time_models"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the columns this revision adds (all rolled up; sample_s a float, the rest integers).
_COLUMNS = (
    "sample_s",
    "held_by_max_num_seqs",
    "held_by_token_budget",
    "held_by_kv_blocks",
    "held_by_partial_prefills",
    "held_by_long_partial_prefills",
    "chunk_deferred_tokens",
)
_STATS = ("min", "max", "sum")


def _columns(table: str) -> list[tuple[str, sa.types.TypeEngine]]:
    if table == "iterations":
        return [(name, sa.Double() if name.endswith("_s") else sa.Integer()) for name in _COLUMNS]
    return [(f"{name}_{stat}", sa.Double()) for name in _COLUMNS for stat in _STATS]


def upgrade() -> None:
    # Rows already stored read 0 (nothing was counted then); the default is dropped afterwards
    # so the schema matches the models, which always write the value.
    for table in ("iterations", "iteration_rollups"):
        with op.batch_alter_table(table) as batch:
            for name, type_ in _columns(table):
                batch.add_column(sa.Column(name, type_, nullable=False, server_default=sa.text("0")))
        with op.batch_alter_table(table) as batch:
            for name, type_ in _columns(table):
                batch.alter_column(name, existing_type=type_, existing_nullable=False, server_default=None)


def downgrade() -> None:
    for table in ("iteration_rollups", "iterations"):
        with op.batch_alter_table(table) as batch:
            for name, _type in reversed(_columns(table)):
                batch.drop_column(name)
