"""Call an ASGI app in process with one buffered HTTP request and stream its response back.

`asgi_request(app, request)` yields a `ResponseStart` first, then the body chunks (bytes). When
the consumer stops early (closes the generator), the app sees `http.disconnect` as with a
client that went away, so the appliance's handlers abort the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message

log = logging.getLogger(__name__)


@dataclass
class ForwardedRequest:
    """An HTTP request as it travels from the ingress to a replica (picklable)."""

    method: str
    path: str  # with the query string, e.g. /admin/knobs?x=1
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""


@dataclass
class ResponseStart:
    status: int
    headers: list[tuple[str, str]]

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


@dataclass
class BufferedResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


async def asgi_request(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    parts = urlsplit(request.path)
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method.upper(),
        "scheme": "http", "path": parts.path, "raw_path": parts.path.encode(), "query_string": parts.query.encode(),
        "root_path": "", "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
    }
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        except Exception:  # Starlette already sent its 500; the cause is logged here
            log.exception("forwarded %s %s failed", request.method, request.path)
        finally:
            await sent.put(None)

    task = asyncio.ensure_future(run())
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                                        for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
    finally:
        gone.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 5.0)
        if not task.done():
            task.cancel()


async def asgi_buffered(app: ASGIApp, request: ForwardedRequest) -> BufferedResponse:
    """The whole response of one request (for small operator routes)."""
    start, chunks = ResponseStart(500, []), []
    async for item in asgi_request(app, request):
        if isinstance(item, ResponseStart):
            start = item
        else:
            chunks.append(item)
    return BufferedResponse(start.status, start.headers, b"".join(chunks))
