"""The fleet's size over time, sampled by the ingress and stored in the telemetry store when it
changes (appliance.telemetry.fleet_sizes)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

SAMPLE_S = 2.0


async def record_sizes(live: Callable[[], Awaitable[list[str]]], db_url: str, fleet_id: str,
                       stop: asyncio.Event) -> None:
    """Every SAMPLE_S count the live replicas and store the count when it changed. A registry or
    store error is logged and tried again at the next sample: serving never waits on it."""
    from ..telemetry import fleet_sizes

    stored: int | None = None
    while not stop.is_set():
        try:
            count = len(await live())
            if count != stored:
                await asyncio.to_thread(fleet_sizes.record, db_url, fleet_id, count, time.time())
                stored = count
        except Exception as exc:  # noqa: BLE001 - a sampling failure must not end the fleet
            log.warning("fleet size not recorded (%s: %s)", type(exc).__name__, exc)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_S)
