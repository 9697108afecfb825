"""The fleet registry: a Ray actor that knows the live replicas, reaches each one by id, and
keeps the fleet's knobs.

Ray Serve's router picks *a* replica; operator routes need *every* replica (a knob change, the
metrics of each) or one by id. Each replica long-polls `next_calls` for requests addressed to it
and answers with `reply`; `call` is what the ingress awaits. A replica that has not polled for
`STALE_AFTER_S` counts as gone (killed, or restarting). The fleet's knobs are the changes every
fleet-wide PATCH made; a replica starting (or restarting) builds its engine with them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import ray

from .bridge import BufferedResponse, ForwardedRequest

REGISTRY_NAMESPACE = "appliance"
POLL_WAIT_S = 1.0
STALE_AFTER_S = 3.0 * POLL_WAIT_S


@ray.remote(num_cpus=0, max_concurrency=1000)
class FleetRegistry:
    """Async actor (all methods run on one event loop, so no locks are needed)."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}
        self._inbox: dict[str, asyncio.Queue[tuple[int, ForwardedRequest]]] = {}
        self._pending: dict[int, asyncio.Future[BufferedResponse]] = {}
        self._ids = itertools.count(1)
        self._knobs: dict[str, Any] = {}

    # -- replicas -----------------------------------------------------------------------------
    async def join(self, replica_id: str) -> dict[str, Any]:
        """Register a replica; returns the fleet's knob changes for its engine to start with. It
        counts as live from its first poll (`next_calls`), when it can answer: between the two it
        finishes starting, which on a loaded host can outlast STALE_AFTER_S, and a replica listed
        at join would drop out again until it polled."""
        self._inbox.setdefault(replica_id, asyncio.Queue())
        return dict(self._knobs)

    async def leave(self, replica_id: str) -> None:
        self._seen.pop(replica_id, None)

    async def replicas(self) -> list[str]:
        now = time.monotonic()
        return sorted(r for r, seen in self._seen.items() if now - seen <= STALE_AFTER_S)

    async def next_calls(self, replica_id: str) -> list[tuple[int, ForwardedRequest]]:
        """Long poll: the requests addressed to `replica_id` (waits up to POLL_WAIT_S for one)."""
        self._seen[replica_id] = time.monotonic()
        inbox = self._inbox.setdefault(replica_id, asyncio.Queue())
        try:
            first = await asyncio.wait_for(inbox.get(), POLL_WAIT_S)
        except asyncio.TimeoutError:
            return []
        finally:
            self._seen[replica_id] = time.monotonic()
        calls = [first]
        while not inbox.empty():
            calls.append(inbox.get_nowait())
        return calls

    async def reply(self, call_id: int, response: BufferedResponse) -> None:
        future = self._pending.pop(call_id, None)
        if future is not None and not future.done():
            future.set_result(response)

    async def call(self, replica_id: str, request: ForwardedRequest, timeout_s: float) -> BufferedResponse | None:
        """Send `request` to one replica; its response, or None when it did not answer in time."""
        call_id = next(self._ids)
        future: asyncio.Future[BufferedResponse] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        await self._inbox.setdefault(replica_id, asyncio.Queue()).put((call_id, request))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            return None
        finally:
            self._pending.pop(call_id, None)

    # -- the fleet's knobs ----------------------------------------------------------------------
    async def fleet_knobs(self) -> dict[str, Any]:
        return dict(self._knobs)

    async def record_knobs(self, changes: dict[str, Any]) -> None:
        self._knobs.update(changes)
