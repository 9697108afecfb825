"""The Starlette application: routes, API-key check, error shapes, lifespan.

`build_app(aeng, config)` returns an app whose lifespan starts the engine loop (and the
telemetry writer, when given) and shuts both down. Draining is driven from outside (the
uvicorn runner in appliance.server.cli calls `app.state.appliance.drain(grace)` on SIGTERM).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine import AsyncEngine
from . import admin, openai_api, simulate
from ..wire import REPLICA_HEADER
from .access_log import DashboardPollingMarker, quiet_dashboard_polling
from .errors import APIError, JSONResponse, ServerErrorCode
from .openapi import build_openapi
from .state import AppState, ServerConfig, ServerStatus, TelemetrySink

log = logging.getLogger(__name__)

PROTECTED_PREFIXES = ("/v1/", "/admin/")
DASHBOARD_PATH = "/ui"


class ApiKeyMiddleware:
    """401 in OpenAI's shape for /v1 and /admin requests without the right bearer key."""

    def __init__(self, app: ASGIApp, state: AppState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            if not self.state.authorized(header):
                message = "Missing API key (send `Authorization: Bearer KEY`)" if not header else "Incorrect API key"
                response = APIError(401, message, code=ServerErrorCode.INVALID_API_KEY,
                                    headers={"WWW-Authenticate": "Bearer"}).response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ReplicaHeaderMiddleware:
    """Names the replica that served each /v1 response in REPLICA_HEADER (one process is a fleet
    of one; behind Ray Serve the router's choice shows in it), so clients can count the balance."""

    def __init__(self, app: ASGIApp, replica_id: str):
        self.app = app
        self.header = (REPLICA_HEADER.lower().encode("latin-1"), replica_id.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, named)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: ServerErrorCode.NOT_FOUND, 405: ServerErrorCode.METHOD_NOT_ALLOWED}.get(exc.status_code)
    message = {404: f"no route {request.url.path}",
               405: f"method {request.method} not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    return APIError(exc.status_code, message, code=code, headers=exc.headers).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, "internal server error", code=ServerErrorCode.INTERNAL_ERROR).response()


async def health(request: Request) -> JSONResponse:
    state: AppState = request.app.state.appliance
    if state.ready:
        return JSONResponse({"status": ServerStatus.OK})
    status = state.status if state.status is not ServerStatus.OK else ServerStatus.ENGINE_STOPPED
    return JSONResponse({"status": status}, status_code=503)


async def metrics(request: Request) -> Response:
    state: AppState = request.app.state.appliance
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def build_app(
    aeng: AsyncEngine, config: ServerConfig | None = None, telemetry: TelemetrySink | None = None
) -> Starlette:
    """The server app around an AsyncEngine (not yet started; the lifespan starts it). The
    dashboard is mounted at /ui when `config.self_url` (this server's own URL) is set."""
    state = AppState(aeng, config or ServerConfig(), telemetry)
    schema = build_openapi(state.requests, state.model_name, auth=state.config.api_key is not None)

    async def openapi(request: Request) -> JSONResponse:
        return JSONResponse(schema)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.start()
        try:
            yield
        finally:
            state.close()

    routes = [
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/v1/models", openai_api.list_models, methods=["GET"]),
        Route("/admin/knobs", admin.knobs, methods=["GET", "PATCH"]),
        Route("/admin/knobs/history", admin.knob_history, methods=["GET"]),
        Route("/admin/state", admin.engine_state, methods=["GET"]),
        Route("/admin/autopilot", admin.autopilot, methods=["GET", "PATCH"]),
        Route("/admin/simulate", simulate.simulate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan,
    )
    app.state.appliance = state
    app.add_middleware(ReplicaHeaderMiddleware, replica_id=state.config.replica_id)
    app.add_middleware(ApiKeyMiddleware, state=state)
    if state.config.self_url:
        _mount_dashboard(app, state)
    return app


def _mount_dashboard(app: Starlette, state: AppState) -> None:
    """The single call site of the Gradio dashboard (ui/app.py), mounted at /ui. It calls this
    server's public API at `config.self_url` and reads the telemetry store."""
    try:
        from ui.app import mount_dashboard
    except ImportError as exc:
        log.warning("dashboard not available (%s); /ui is not mounted", exc)
        return
    from ..settings import CONFIG_DIR
    from ..telemetry.store import DEFAULT_URL

    config = state.config
    assert config.self_url is not None
    try:
        mount_dashboard(app, config.self_url, config.db_url or DEFAULT_URL, config.api_key, CONFIG_DIR,
                        path=DASHBOARD_PATH)
    except Exception:  # a broken dashboard must not take the API down
        log.exception("mounting the dashboard failed; /ui is not available")
        return
    app.add_middleware(DashboardPollingMarker, mount_path=DASHBOARD_PATH)
    quiet_dashboard_polling()
