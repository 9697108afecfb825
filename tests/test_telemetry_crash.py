"""kill -9 of a process in the middle of writing telemetry leaves a sound SQLite store that
still holds every row the process saw committed."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import sys, time
    from appliance.engine.stats import IterationStats
    from appliance.telemetry.writer import TelemetryWriter

    writer = TelemetryWriter(sys.argv[1], "crash", flush_interval_s=0.01).start()
    i, t0 = 0, time.time()
    while True:
        for _ in range(500):
            writer.on_iteration(IterationStats(
                i, t0 + i * 0.001, 0.001, 0.0, 4, 1, 1, 32, 3, 3, 35, 0, 512, 64,
                10, 90, 100, 0, 0, 1, 0, 0, 0, 0, 0, 0, "continuous", 3 * 40, 0, 0, 0))
            i += 1
        if not writer.flush(30):
            sys.exit("flush timed out")
        print(writer.rows_written, flush=True)
    """
)


@pytest.mark.parametrize("kill_after_rows", [2_000, 40_000])
def test_kill_9_while_writing_keeps_every_committed_row(tmp_path: Path, kill_after_rows: int) -> None:
    path = tmp_path / "appliance.db"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, f"sqlite:///{path}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    committed = 0
    try:
        assert child.stdout is not None
        deadline = time.monotonic() + 60
        while committed < kill_after_rows and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            committed = int(line)
        assert committed >= kill_after_rows, child.stderr.read() if child.poll() is not None else "too slow"
        # The child keeps writing; kill it mid-stream, as an OOM killer or power cut would.
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(10)
    assert child.returncode == -signal.SIGKILL
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        stored = conn.execute("SELECT count(*) FROM iterations").fetchone()[0]
        assert stored >= committed
        # Rows and their rollup were committed together: they still agree.
        assert conn.execute("SELECT coalesce(sum(n), 0) FROM iteration_rollups").fetchone()[0] == stored
        numbers = [r[0] for r in conn.execute("SELECT iteration FROM iterations ORDER BY iteration")]
        assert numbers == list(range(stored))  # no gaps, no duplicates
    finally:
        conn.close()
