"""Prefix caching: per-iteration cached-free blocks and prefix-cache lookups/hits (and their 1 s
rollups), per-request cached prompt tokens.

Rows written before this revision read 0 in the new columns (there was no cache then).

Revision ID: 0005_prefix_cache
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_prefix_cache"
down_revision: str | None = "0004_binding_counters"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the columns this revision adds.
_ITERATION_COLUMNS = ("kv_blocks_cached_free", "prefix_cache_queries", "prefix_cache_hits")
_REQUEST_COLUMNS = ("cached_tokens",)
_ROLLUP_STATS = ("min", "max", "sum")


def _add(table: str, columns: list[tuple[str, sa.types.TypeEngine]]) -> None:
    """Add NOT NULL columns, existing rows reading 0; the default is dropped afterwards so the
    schema matches the models (which have none)."""
    with op.batch_alter_table(table) as batch:
        for name, type_ in columns:
            batch.add_column(sa.Column(name, type_, nullable=False, server_default="0"))
    with op.batch_alter_table(table) as batch:
        for name, type_ in columns:
            batch.alter_column(name, existing_type=type_, existing_nullable=False, server_default=None)


def upgrade() -> None:
    _add("iterations", [(name, sa.Integer()) for name in _ITERATION_COLUMNS])
    _add("requests", [(name, sa.Integer()) for name in _REQUEST_COLUMNS])
    _add("iteration_rollups",
         [(f"{name}_{stat}", sa.Double()) for name in _ITERATION_COLUMNS for stat in _ROLLUP_STATS])


def downgrade() -> None:
    for table, names in (
        ("iteration_rollups", [f"{n}_{s}" for n in _ITERATION_COLUMNS for s in _ROLLUP_STATS]),
        ("requests", list(_REQUEST_COLUMNS)),
        ("iterations", list(_ITERATION_COLUMNS)),
    ):
        with op.batch_alter_table(table) as batch:
            for name in reversed(names):
                batch.drop_column(name)
