"""The telemetry writer's handle on its store: opened on first use and brought to the head
revision, checked against the models (schema mismatch), and, for a SQLite file, recreated at
the head revision when the file is deleted or replaced while open (detected by inode).

Ownership: a StoreHandle belongs to the writer thread alone (no lock); nothing here is read
by another thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from sqlalchemy.engine import Engine, make_url

from appliance.telemetry import store

log = logging.getLogger("appliance.telemetry")


class StoreReplaced(Exception):
    """The SQLite file changed under the batch just committed; write it again to the new one."""


class SchemaMismatch(Exception):
    """The store lacks tables or columns the models write (store.missing_columns): the models
    and the migrations disagree. A bug, not an outage: waiting cannot fix it."""


class StoreHandle:
    """An Engine on `url`, (re)made as needed. Its schema is checked whenever the engine is
    new and after every failed check, so writing resumes once a mismatched store is migrated."""

    def __init__(self, url: str, *, busy_timeout_ms: int, sqlite_pragmas: Mapping[str, int | str]) -> None:
        self._url = url
        self.safe_url = make_url(url).render_as_string(hide_password=True)
        self._sqlite_path = sqlite_file(url)
        self._busy_timeout_ms = busy_timeout_ms
        self._sqlite_pragmas = dict(sqlite_pragmas)
        self._head = store.head()
        self._known_revisions = set(store.revisions())
        self._engine: Engine | None = None
        self._file_id: tuple[int, int] | None = None
        self._schema_ok = False
        self._mismatch_reported = False

    def open(self) -> Engine:
        """The engine to write with; (re)creates the store when needed. Raises SchemaMismatch
        (logged as an error once, until the store matches again) when it cannot take the
        models' rows."""
        if self._file_id is not None and self._stat() != self._file_id:
            log.warning("telemetry store %s was deleted or replaced; recreating it", self.safe_url)
            self.dispose()  # closing the old connections first lets SQLite tidy its -wal/-shm
            self._file_id = None
        if self._engine is None:
            self._engine = store.make_engine(
                self._url, busy_timeout_ms=self._busy_timeout_ms, sqlite_pragmas=self._sqlite_pragmas
            )
            self._schema_ok = False
        if not self._schema_ok:
            self._check_schema(self._engine)
            if self._sqlite_path:
                self._file_id = self._stat()
        return self._engine

    def check_not_replaced(self) -> None:
        """Raise StoreReplaced when the SQLite file is no longer the one open() checked (a
        commit just made went to a deleted or replaced file)."""
        if self._sqlite_path and self._stat() != self._file_id:
            raise StoreReplaced()

    def dispose(self) -> None:
        """Close every connection; the next open() makes a fresh engine and checks the schema."""
        if self._engine is not None:
            try:
                self._engine.dispose()
            except Exception:  # noqa: BLE001 - closing a broken connection may fail too
                log.debug("disposing the telemetry engine failed", exc_info=True)
        self._engine = None
        self._schema_ok = False

    def _check_schema(self, engine: Engine) -> None:
        revision = store.current(engine)
        if revision is None or (revision != self._head and revision in self._known_revisions):
            log.info("telemetry store %s at revision %s; upgrading", self.safe_url, revision)
            store.upgrade(engine)
        missing = store.missing_columns(engine)
        if missing:
            if not self._mismatch_reported:
                log.error(
                    "telemetry store %s lacks %s, which the models write: the models and the "
                    "migrations disagree (a bug: add the migration). Telemetry is dropped until the "
                    "store matches.",
                    self.safe_url,
                    ", ".join(missing),
                )
                self._mismatch_reported = True
            raise SchemaMismatch(", ".join(missing))
        self._schema_ok = True
        self._mismatch_reported = False

    def _stat(self) -> tuple[int, int] | None:
        assert self._sqlite_path is not None
        try:
            st = os.stat(self._sqlite_path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino)


def sqlite_file(url: str) -> str | None:
    """The absolute path of a file-backed SQLite URL (plain or `file:` URI form), else None."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        return None
    database = parsed.database
    if database.startswith("file:"):
        database = database[len("file:") :].split("?", 1)[0]
        if database.startswith("//"):
            database = database[2:]
    if database in ("", ":memory:") or parsed.query.get("mode") == "memory":
        return None
    return os.path.abspath(database)
