"""Alembic environment of the telemetry store.

The appliance runs migrations in code (appliance.telemetry.store.upgrade), handing over an
open connection in `config.attributes["connection"]`. From the `alembic` command line the URL
comes from the config's sqlalchemy.url, else $APPLIANCE_DB_URL, else the default SQLite file.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy.engine import Connection

from appliance.telemetry.models import Base
from appliance.telemetry.store import DEFAULT_URL, make_engine

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or os.environ.get("APPLIANCE_DB_URL") or DEFAULT_URL


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
