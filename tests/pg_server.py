"""A throwaway PostgreSQL server for tests: initdb + pg_ctl (as the `postgres` OS user when run as
root) on a free 127.0.0.1 port, stopped and started again on demand (a store that goes down and
comes back), removed at the end. `postgres_server()` skips the calling test, with the reason,
only when no server can be started here."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from conftest import free_port


class PostgresServer:
    """One cluster with a database `appliance`, reachable at `url` while it runs."""

    def __init__(self, bindir: str, prefix: list[str]):
        self.bindir, self.prefix = bindir, prefix
        self.root = tempfile.mkdtemp(prefix="appliance-pg-")
        if prefix:
            shutil.chown(self.root, "postgres")
        self.data = os.path.join(self.root, "data")
        self.port = free_port()
        self.pid: int | None = None
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/appliance"

    def _run(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix, *cmd], capture_output=True, text=True, timeout=120)

    def init(self) -> str | None:
        """initdb, start, createdb; the reason it failed, or None."""
        done = self._run(f"{self.bindir}/initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8")
        if done.returncode != 0:
            return f"initdb failed: {done.stderr.strip()[-500:]}"
        reason = self.start()
        if reason is None:
            created = self._run(f"{self.bindir}/createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                                "appliance")
            reason = None if created.returncode == 0 else f"createdb failed: {created.stderr.strip()[-300:]}"
        return reason

    def start(self) -> str | None:
        log = os.path.join(self.root, "log")
        done = self._run(f"{self.bindir}/pg_ctl", "-D", self.data, "-l", log, "-w", "-t", "60", "-o",
                         f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} "
                         "-c fsync=off", "start")
        if done.returncode != 0:
            tail = open(log).read()[-500:] if os.path.exists(log) else ""
            return f"pg_ctl start failed: {done.stderr.strip()[-300:]} {tail}"
        with open(os.path.join(self.data, "postmaster.pid")) as f:
            self.pid = int(f.readline())
        return None

    def stop(self) -> None:
        """Fast shutdown (SIGINT to the postmaster this server started): clients are cut off."""
        if self.pid is None:
            return
        os.kill(self.pid, signal.SIGINT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        self.pid = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    bindirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    if not bindirs:
        pytest.skip("no PostgreSQL binaries under /usr/lib/postgresql/*/bin")
    prefix: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no `postgres` OS user to run initdb as")
        prefix = ["runuser", "-u", "postgres", "--"]
    server = PostgresServer(bindirs[-1], prefix)
    try:
        reason = server.init()
        if reason is not None:
            pytest.skip(reason)
        yield server
    finally:
        server.remove()
