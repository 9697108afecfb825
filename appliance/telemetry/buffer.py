"""The bounded buffer between the engine's threads and the telemetry writer's thread.

Ownership: this is the only writer state that the engine's threads touch. Everything in it is
guarded by one lock, held for a few deque operations and never across I/O, so an engine
thread appending a record never waits on the store. The engine's threads `put`; the writer
thread `take`s everything at once and adds the records it could not write to the drop count.
"""

from __future__ import annotations

import threading
from collections import deque

from appliance.telemetry.batch import Record


class RecordBuffer:
    """Records waiting to be written, at most `capacity` (the oldest is dropped first), and the
    counts of records ever handed over and ever dropped."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._records: deque[Record] = deque()
        self._appended = 0
        self._dropped = 0
        self._closed = False

    def put(self, record: Record) -> None:
        """Append `record` (dropping the oldest when full; dropping it when closed)."""
        with self._lock:
            self._appended += 1
            if self._closed:
                self._dropped += 1
                return
            if len(self._records) >= self.capacity:
                self._records.popleft()
                self._dropped += 1
            self._records.append(record)

    @property
    def appended(self) -> int:
        """Records handed over so far (kept or not)."""
        with self._lock:
            return self._appended

    @property
    def dropped(self) -> int:
        """Records dropped so far, here or by the writer (count_dropped)."""
        with self._lock:
            return self._dropped

    def waiting(self) -> bool:
        with self._lock:
            return bool(self._records)

    def take(self) -> tuple[deque[Record], int]:
        """Everything buffered (leaving the buffer empty) and the drop count at that moment."""
        with self._lock:
            taken, self._records = self._records, deque()
            return taken, self._dropped

    def count_dropped(self, n: int) -> int:
        """Add `n` records the writer lost to the drop count; returns the new count."""
        with self._lock:
            self._dropped += n
            return self._dropped

    def close(self) -> None:
        """Refuse further records: each one handed over from now on is counted as dropped."""
        with self._lock:
            self._closed = True

    def discard(self, unwritten: int) -> int:
        """Drop what is buffered plus `unwritten` records taken earlier and never written;
        returns how many that is."""
        with self._lock:
            lost = unwritten + len(self._records)
            self._records.clear()
            self._dropped += lost
            return lost
