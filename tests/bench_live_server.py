"""A real appliance server whose telemetry goes to a SQLite store, for the bench, report, A/B
and tune tests: the conftest's `server_factory` (own engine over the shared model, uvicorn on
127.0.0.1) with a TelemetryWriter under the same replica id the server reports, so runs and
their ITERATION / requests rows line up."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

REPLICA = "test"  # conftest's server_factory serves under this replica id


@contextmanager
def telemetry_server(server_factory: Callable[..., Any], db_url: str, **kwargs: Any) -> Iterator[Any]:
    """Yield the LiveServer; `srv.writer.flush()` writes every record handed over so far."""
    from appliance.telemetry import store
    from appliance.telemetry.writer import TelemetryWriter

    store.upgrade(db_url)
    writer = TelemetryWriter(db_url, REPLICA, flush_interval_s=0.05)
    with server_factory(telemetry=writer, **kwargs) as srv:
        engine = srv.state.engine
        if writer not in engine.sinks:  # the engine must feed the store the reports read
            engine.add_sink(writer)
        srv.writer = writer
        yield srv
