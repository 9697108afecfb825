"""The fleet's one port: OpenAI routes forwarded through Ray Serve's router, operator routes fanned
out to every replica (or `?replica=ID`), /metrics merged with a `replica` label, the dashboard.

OpenAI requests go through a DeploymentHandle, so Ray Serve's request router picks the replica;
responses stream back chunk by chunk (the replica's id in the `x-appliance-replica` header). A
replica lost mid-response ends a stream with an OpenAI-shaped error event and a buffered response
with a 503, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ..server.app import ApiKeyMiddleware, _api_error, _http_error, _internal_error, _mount_dashboard
from ..server.errors import APIError, JSONResponse, ServerErrorCode, draining_error, error_object
from ..server.protocol import parse_json, read_body
from ..server.state import AppState, ServerConfig
from .bridge import BufferedResponse, ForwardedRequest, ResponseStart
from .drain import IngressDrain
from .metrics import merge_replica_metrics
from .sizes import record_sizes

log = logging.getLogger(__name__)

FANOUT_TIMEOUT_S = 40.0  # above the admin route's own 30 s wait for a knob change to apply
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "authorization", "host"}


@dataclass
class Fleet:
    """What the ingress reaches the replicas by: Ray Serve's handle and the fleet registry."""

    handle: Any  # ray.serve.handle.DeploymentHandle of EngineReplica
    registry: Any  # ActorHandle of FleetRegistry
    config: ServerConfig  # api_key, max_body_bytes, db_url, self_url (the dashboard's)

    async def replicas(self) -> list[str]:
        return await self.registry.replicas.remote()

    async def call_each(self, request: ForwardedRequest, only: str | None = None) -> dict[str, BufferedResponse | None]:
        """The response of each live replica (or of `only`); None for one that did not answer."""
        ids = await self.replicas()
        if only is not None:
            if only not in ids:
                raise APIError(404, f"no live replica {only!r}; live replicas: {', '.join(ids) or 'none'}",
                               param="replica", code=ServerErrorCode.REPLICA_NOT_FOUND)
            ids = [only]
        if not ids:
            raise APIError(503, "no replica is serving", code=ServerErrorCode.ENGINE_UNAVAILABLE)
        answers = await asyncio.gather(*(self.registry.call.remote(r, request, FANOUT_TIMEOUT_S) for r in ids))
        return dict(zip(ids, answers))


class _KeyCheck:
    """The API-key check of AppState, for the ingress's ApiKeyMiddleware."""

    authorized = AppState.authorized

    def __init__(self, api_key: str | None):
        self._key = api_key.encode() if api_key else None


def _forwarded(request: Request, body: bytes) -> ForwardedRequest:
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    headers = [(k, v) for k, v in request.headers.items() if k not in _HOP_HEADERS]
    return ForwardedRequest(request.method, path, headers, body)


def _response_headers(start: ResponseStart | BufferedResponse) -> dict[str, str]:
    return {k: v for k, v in start.headers if k.lower() not in _HOP_HEADERS}


def _lost(exc: BaseException) -> APIError:
    return APIError(503, f"the replica serving this request was lost ({type(exc).__name__}); retry",
                    type="server_error", code=ServerErrorCode.REPLICA_UNAVAILABLE, headers={"Retry-After": "1"})


def _json(answer: BufferedResponse) -> dict[str, Any]:
    return json.loads(answer.body) if answer.body else {}


def build_ingress(fleet: Fleet, drain: IngressDrain | None = None) -> Starlette:
    """The ingress app; `drain` is what its server's SIGTERM handler drains (a new one if None)."""
    config = fleet.config
    drain = drain or IngressDrain()

    async def forward(request: Request) -> Response:
        """An OpenAI route: to the replica Ray Serve's router picks, streamed back."""
        drain.admit()
        body = await read_body(request, config.max_body_bytes)
        stream = fleet.handle.options(stream=True).http.remote(_forwarded(request, body))
        drain.opened(stream)
        relayed = False
        try:
            start = await stream.__anext__()
            if (start.header("content-type") or "").startswith("text/event-stream"):
                relayed = True  # _relay closes it
                return StreamingResponse(_relay(stream, drain), status_code=start.status,
                                         headers=_response_headers(start))
            chunks = [chunk async for chunk in stream]
        except Exception as exc:  # noqa: BLE001 - the replica died, none could take it, or the drain cut it
            raise (draining_error(cut=True) if drain.closed(stream) else _lost(exc)) from None
        finally:
            if not relayed:
                drain.closed(stream)
        return Response(b"".join(chunks), status_code=start.status, headers=_response_headers(start))

    async def knobs(request: Request) -> JSONResponse:
        only = request.query_params.get("replica")
        body = await read_body(request, config.max_body_bytes) if request.method == "PATCH" else b""
        if request.method == "PATCH":
            parse_json(body)  # malformed JSON: a 400 here, before any replica is asked
        forwarded = _forwarded(request, body)
        forwarded.path = request.url.path  # the replica's own route knows no ?replica=
        answers = await fleet.call_each(forwarded, only)
        failed = {r: a for r, a in answers.items() if a is None or a.status != 200}
        per_replica = {r: _knob_summary(a) for r, a in answers.items()}
        if failed:
            replica, answer = next(iter(failed.items()))
            if answer is None:
                raise APIError(503, f"replica {replica} did not answer", code=ServerErrorCode.REPLICA_UNAVAILABLE,
                               extra={"replicas": per_replica})
            return JSONResponse({**_json(answer), "replicas": per_replica}, status_code=answer.status)
        if request.method == "PATCH" and only is None:
            await fleet.registry.record_knobs.remote(parse_json(body))
        first = _json(next(iter(answers.values())))
        return JSONResponse({**first, "replicas": per_replica,
                             "fleet_knobs": await fleet.registry.fleet_knobs.remote()})

    async def knob_history(request: Request) -> JSONResponse:
        answers = await fleet.call_each(_forwarded(request, b""), request.query_params.get("replica"))
        rows = [{**row, "replica": replica} for replica, answer in answers.items() if answer is not None
                for row in _json(answer).get("data", [])]
        return JSONResponse({"data": sorted(rows, key=lambda row: row.get("applied_at", 0.0))})

    async def engine_state(request: Request) -> JSONResponse:
        answers = await fleet.call_each(_forwarded(request, b""), request.query_params.get("replica"))
        views = {r: _json(a) for r, a in answers.items() if a is not None and a.status == 200}
        if not views:
            raise APIError(503, "no replica answered", code=ServerErrorCode.REPLICA_UNAVAILABLE)
        return JSONResponse({**next(iter(views.values())), "replicas": views})

    async def metrics(request: Request) -> Response:
        answers = await fleet.call_each(ForwardedRequest("GET", "/metrics"))
        texts = {r: a.body.decode() for r, a in answers.items() if a is not None and a.status == 200}
        return Response(merge_replica_metrics(texts), media_type=CONTENT_TYPE_LATEST)

    async def health(request: Request) -> JSONResponse:
        if drain.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        replicas = await fleet.replicas()
        return JSONResponse({"status": "ok" if replicas else "no_replicas", "replicas": replicas},
                            status_code=200 if replicas else 503)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        stop = asyncio.Event()
        sampler = (asyncio.ensure_future(record_sizes(fleet.replicas, config.db_url, config.replica_id, stop))
                   if config.db_url else None)
        try:
            yield
        finally:
            stop.set()
            if sampler is not None:
                await sampler

    routes = [
        Route("/v1/chat/completions", forward, methods=["POST"]),
        Route("/v1/completions", forward, methods=["POST"]),
        Route("/v1/models", forward, methods=["GET"]),
        Route("/openapi.json", forward, methods=["GET"]),
        Route("/admin/knobs", knobs, methods=["GET", "PATCH"]),
        Route("/admin/knobs/history", knob_history, methods=["GET"]),
        Route("/admin/state", engine_state, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error})
    app.add_middleware(ApiKeyMiddleware, state=_KeyCheck(config.api_key))
    if config.self_url:
        _mount_dashboard(app, _DashboardSettings(config))
    return app


@dataclass
class _DashboardSettings:
    """The one attribute of AppState the dashboard mount reads."""

    config: ServerConfig


def _knob_summary(answer: BufferedResponse | None) -> dict[str, Any]:
    if answer is None:
        return {"status": None, "error": "did not answer"}
    body = _json(answer)
    if answer.status != 200:
        return {"status": answer.status, "error": body.get("error")}
    return {"status": 200, "version": body.get("version"), "iteration": body.get("iteration"),
            "knobs": body.get("knobs")}


async def _relay(stream: Any, drain: IngressDrain) -> AsyncIterator[bytes]:
    """A replica's event stream, ended by an OpenAI-shaped error event if the replica is lost or
    the drain cut it."""
    try:
        async for chunk in stream:
            yield chunk
    except Exception as exc:  # noqa: BLE001
        cut = drain.closed(stream)
        if not cut:
            log.warning("replica lost mid-stream: %s", exc)
        error = draining_error(cut=True) if cut else _lost(exc)
        yield f"data: {json.dumps({'error': error_object(error.message, error.type, None, error.code)})}\n\n".encode()
    finally:
        drain.closed(stream)
        stream.cancel()  # the client went away (or the stream ended): free the replica's slot
