"""Whether the telemetry store can be written, and when to try again while it cannot: backoff
between attempts and a warning at most once per log interval while it fails, one more when it
recovers.

Ownership: a StoreHealth is changed by the writer thread alone; other threads only read
`healthy` (one attribute, written whole).
"""

from __future__ import annotations

import logging
import math
import time

log = logging.getLogger("appliance.telemetry")


class StoreHealth:
    """Backoff doubles from `min_backoff_s` up to `max_backoff_s` while attempts fail."""

    def __init__(self, safe_url: str, *, min_backoff_s: float, max_backoff_s: float, log_interval_s: float) -> None:
        self._safe_url = safe_url
        self._min_backoff = min_backoff_s
        self._max_backoff = max_backoff_s
        self._log_interval = log_interval_s
        self.healthy = True  # the last write attempt succeeded
        self.retry_at = 0.0  # time.monotonic() before which no write is attempted
        self._backoff = 0.0
        self._failures_unreported = 0
        self._last_report = -math.inf

    def failed(self, exc: Exception, rows_dropped: int) -> None:
        """A write or prune attempt failed: back off, and warn unless warned recently."""
        self.healthy = False
        self._backoff = min(self._max_backoff, max(self._min_backoff, self._backoff * 2))
        self.retry_at = time.monotonic() + self._backoff
        self._failures_unreported += 1
        now = time.monotonic()
        if now - self._last_report >= self._log_interval:
            log.warning(
                "telemetry store %s not writable (%d failed attempts since last report, "
                "%d rows dropped in all, next attempt in %.1fs): %s: %s",
                self._safe_url,
                self._failures_unreported,
                rows_dropped,
                self._backoff,
                type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            self._last_report = now
            self._failures_unreported = 0

    def mismatched(self) -> None:
        """The store's schema cannot take the rows: unhealthy, but no backoff (waiting cannot
        fix a bug; the schema is checked again every round)."""
        self.healthy = False

    def succeeded(self, rows_dropped: int) -> None:
        """A write succeeded: no backoff, and say so when it had been failing."""
        if not self.healthy:
            log.warning("telemetry store %s writable again (%d rows dropped in all)", self._safe_url, rows_dropped)
        self.healthy = True
        self._backoff = 0.0
        self.retry_at = 0.0
        self._failures_unreported = 0
        self._last_report = -math.inf
