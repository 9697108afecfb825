"""Opening the telemetry store and managing its schema with Alembic.

Any SQLAlchemy URL works; the default is a SQLite file in the working folder. Several
appliance processes may share one PostgreSQL store, each writing under its own replica id.
The schema is only ever created or changed by the migrations in the top-level `migrations/`
folder (Alembic is configured here in code; no alembic.ini is needed).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.engine import Connection, Engine, make_url

import appliance
from appliance.telemetry.models import Base

DEFAULT_URL = "sqlite:///appliance.db"
MIGRATIONS_DIR = Path(appliance.__file__).resolve().parents[1] / "migrations"
DEFAULT_BUSY_TIMEOUT_MS = 5000
# How long an upgrade waits for another process's migration to release an SQLite store: it holds
# the write lock for the whole upgrade, which on a loaded machine outlasts the busy timeout above.
MIGRATION_WAIT_MS = 120_000
# Serializes concurrent upgrades of one PostgreSQL store (any constant shared by all processes).
_PG_MIGRATION_LOCK = 0x6170706C  # "appl"
# Alembic's `context` proxy is process-global: one migration command at a time per process.
_ALEMBIC_LOCK = threading.Lock()


def make_engine(
    url: str = DEFAULT_URL,
    *,
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS,
    sqlite_pragmas: Mapping[str, int | str] | None = None,
) -> Engine:
    """Create an Engine for `url`.

    SQLite connections get WAL journaling, synchronous=NORMAL, a busy timeout, foreign keys,
    any extra `sqlite_pragmas` (e.g. {"max_page_count": 100} to cap the file size), and real
    transactions: pysqlite's own implicit BEGIN is replaced by an explicit one, so DDL is
    transactional too and a connection with execution option `sqlite_begin="IMMEDIATE"`
    takes the write lock at BEGIN.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True)
    engine = create_engine(parsed, connect_args={"check_same_thread": False})
    extra = dict(sqlite_pragmas or {})
    for name, value in extra.items():
        if (
            not name.isidentifier()
            or not isinstance(value, (int, str))
            or (isinstance(value, str) and not value.isidentifier())
        ):
            raise ValueError(f"invalid SQLite pragma {name}={value!r}")

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves (see _on_begin)
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            cursor.execute("PRAGMA foreign_keys = ON")
            for name, value in extra.items():
                cursor.execute(f"PRAGMA {name} = {value}")
            if parsed.database not in (None, "", ":memory:"):
                cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", "")
        if mode not in ("", "DEFERRED", "IMMEDIATE", "EXCLUSIVE"):
            raise ValueError(f"invalid sqlite_begin mode {mode!r}")
        conn.exec_driver_sql(f"BEGIN {mode}".strip())

    return engine


@contextmanager
def using_engine(target: str | Engine) -> Iterator[Engine]:
    """Yield an Engine for a URL or an Engine; an engine made here is disposed afterwards."""
    if isinstance(target, Engine):
        yield target
        return
    engine = make_engine(target)
    try:
        yield engine
    finally:
        engine.dispose()


def _config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        # ConfigParser interpolation would choke on '%' (URL-encoded passwords).
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


@contextmanager
def _migration_connection(target: str | Engine) -> Iterator[tuple[Config, Connection]]:
    """A locked transaction to run migrations in, and an Alembic config that uses it."""
    with using_engine(target) as engine:
        url = engine.url.render_as_string(hide_password=False)
        cfg = _config(url)
        with engine.connect().execution_options(sqlite_begin="IMMEDIATE") as conn:
            with _sqlite_wait(conn, MIGRATION_WAIT_MS), conn.begin():
                if conn.dialect.name == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
                cfg.attributes["connection"] = conn
                yield cfg, conn


@contextmanager
def _sqlite_wait(conn: Connection, wait_ms: int) -> Iterator[None]:
    """On SQLite, `conn` waits up to `wait_ms` for a lock while inside (its busy timeout set on the
    driver's connection, outside any transaction, and restored afterwards for the pool)."""
    if conn.dialect.name != "sqlite":
        yield
        return
    raw = conn.connection.driver_connection
    previous = raw.execute("PRAGMA busy_timeout").fetchone()[0]
    raw.execute(f"PRAGMA busy_timeout = {int(wait_ms)}")
    try:
        yield
    finally:
        raw.execute(f"PRAGMA busy_timeout = {int(previous)}")


def upgrade(url: str | Engine = DEFAULT_URL, revision: str = "head") -> None:
    """Migrate the store at `url` up to `revision` (creating it if empty)."""
    with _ALEMBIC_LOCK, _migration_connection(url) as (cfg, _conn):
        command.upgrade(cfg, revision)


def downgrade(url: str | Engine, revision: str) -> None:
    """Migrate the store down to `revision` ("-1" for one step, "base" for empty)."""
    with _ALEMBIC_LOCK, _migration_connection(url) as (cfg, _conn):
        command.downgrade(cfg, revision)


def current(url: str | Engine = DEFAULT_URL) -> str | None:
    """The revision the store is at, or None when it has never been migrated."""
    with using_engine(url) as engine, engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def missing_columns(url: str | Engine = DEFAULT_URL) -> list[str]:
    """What the models have and the store lacks, as "table" or "table.column" (empty when the
    store holds every model column). Anything listed means the models and the migrations
    disagree: a bug to fix with a migration, not a store to wait for."""
    with using_engine(url) as engine, engine.connect() as conn:
        insp = inspect(conn)
        present = set(insp.get_table_names())
        missing: list[str] = []
        for table in Base.metadata.sorted_tables:
            if table.name not in present:
                missing.append(table.name)
                continue
            columns = {c["name"] for c in insp.get_columns(table.name)}
            missing += [f"{table.name}.{c.name}" for c in table.columns if c.name not in columns]
    return missing


def revisions() -> list[str]:
    """Every revision the migrations folder defines, newest first."""
    return [script.revision for script in ScriptDirectory.from_config(_config()).walk_revisions()]


def head() -> str:
    """The newest revision the migrations folder defines."""
    rev = ScriptDirectory.from_config(_config()).get_current_head()
    if rev is None:  # pragma: no cover - the folder ships with revisions
        raise RuntimeError(f"no migrations found in {MIGRATIONS_DIR}")
    return rev
