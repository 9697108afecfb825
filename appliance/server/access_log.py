"""Keep the dashboard's own polling out of uvicorn's access log at INFO.

An open dashboard refreshes its Live tab every 1-4 s: a Gradio queue event (and its heartbeat)
under the mount path, and the dashboard's GETs of /admin/state and /admin/knobs (sent with
`X-Appliance-Source: dashboard`). Logged at INFO that is several lines every few seconds that
say nothing. `DashboardPollingMarker` (ASGI middleware) marks those requests in a context
variable, which uvicorn's access-log call sees because it runs inside the app's `send`;
`QuietDashboardPolling` (a filter on the `uvicorn.access` logger) turns the marked records into
DEBUG records, shown only when that logger is enabled for DEBUG (`--log-level DEBUG`). Every
other request, the dashboard's knob changes (PATCH) and page loads included, is logged as before.
"""

from __future__ import annotations

import contextvars
import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from ..wire import SOURCE_HEADER

ACCESS_LOGGER = "uvicorn.access"
RAW_SOURCE_HEADER = SOURCE_HEADER.lower().encode("latin-1")  # as ASGI scopes carry it
DASHBOARD_SOURCE = b"dashboard"
GRADIO_POLLING = ("/gradio_api/queue/", "/gradio_api/heartbeat/")  # under the dashboard's mount path

_polling: contextvars.ContextVar[bool] = contextvars.ContextVar("dashboard_polling", default=False)


def is_dashboard_polling(scope: Scope, mount_path: str) -> bool:
    """Whether an HTTP request is the dashboard's own refresh traffic."""
    path = scope.get("path", "")
    if path.startswith(tuple(mount_path.rstrip("/") + p for p in GRADIO_POLLING)):
        return True
    if scope.get("method") != "GET":
        return False
    return any(k == RAW_SOURCE_HEADER and v.strip().lower() == DASHBOARD_SOURCE for k, v in scope.get("headers", ()))


class DashboardPollingMarker:
    """Marks the dashboard's polling requests for `QuietDashboardPolling`."""

    def __init__(self, app: ASGIApp, mount_path: str = "/ui"):
        self.app = app
        self.mount_path = mount_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_dashboard_polling(scope, self.mount_path):
            await self.app(scope, receive, send)
            return
        token = _polling.set(True)
        try:
            await self.app(scope, receive, send)
        finally:
            _polling.reset(token)


class QuietDashboardPolling(logging.Filter):
    """Access-log records of marked requests become DEBUG records (dropped unless DEBUG is on)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _polling.get():
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_dashboard_polling() -> None:
    """Install QuietDashboardPolling on uvicorn's access logger (once)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, QuietDashboardPolling) for f in logger.filters):
        logger.addFilter(QuietDashboardPolling())
