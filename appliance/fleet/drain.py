"""The fleet ingress's graceful stop: what `appliance serve --replicas N` does on SIGINT/SIGTERM.

As on one box (`--drain-grace-s`): new OpenAI requests get 503 "draining" and /health 503;
requests in flight get the grace to finish; the ones still running after it are cancelled
through Ray Serve (the replica aborts them and frees their KV blocks) and their responses end
with a "draining" error (a stream with an OpenAI-shaped error event). The ingress then exits
and the replicas are stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ..server.errors import draining_error

log = logging.getLogger(__name__)

RESPONSE_WRITE_WAIT_S = 5.0  # after the cut: how long the responses get to write their last event


class IngressDrain:
    """The OpenAI requests the ingress has in flight (their Ray Serve response streams), and
    whether it still admits new ones. Used from the ingress's event loop only."""

    def __init__(self) -> None:
        self.draining = False
        self._streams: dict[Any, bool] = {}  # stream -> cut by the drain

    def admit(self) -> None:
        """Raise the 503 "draining" error once the drain has begun."""
        if self.draining:
            raise draining_error()

    def opened(self, stream: Any) -> None:
        self._streams[stream] = False

    def closed(self, stream: Any) -> bool:
        """Forget `stream`; True when the drain cut it (its response ends with the draining error)."""
        return self._streams.pop(stream, False)

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    async def drain(self, grace_s: float) -> int:
        """Stop admitting, wait up to `grace_s` for the requests in flight, cancel the rest and
        wait for their responses to end. Returns how many were cut."""
        self.draining = True
        log.info("draining the fleet ingress: %d request(s) in flight, %.1fs grace", self.in_flight, grace_s)
        await self._wait_until_idle(grace_s)
        cut = [stream for stream in self._streams if not self._streams[stream]]
        for stream in cut:
            self._streams[stream] = True
            stream.cancel()
        await self._wait_until_idle(RESPONSE_WRITE_WAIT_S)
        log.info("drained (%d request(s) aborted)", len(cut))
        return len(cut)

    async def _wait_until_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
