"""A tiny OpenAI-shaped streaming server for testing the bench client's own logic.

Only for the load generator's parsing, arrival, timing and cancel logic: it streams made-up
tokens. The client against the real appliance server is tested elsewhere.

/v1/chat/completions streams the same way, in chat chunks (a role chunk first); its "prompt" is
the last message's content and its text pieces name the request (" chatcmpl-<n>:<i>"), so a test
can tell whose answer a later turn carries.

Behaviour is chosen per request by the prompt text: "http400" / "http429" / "http500" reply with
that error, "drop" streams two chunks then ends without [DONE], "error-event" sends an error
event mid-stream, "abort" finishes with finish_reason "abort", "hang" streams nothing for a long
time, "huge-line" sends an event line of 600 KiB (over the client's line limit); anything else
(text or token ids) streams `max_tokens` chunks `token_delay` apart.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


@dataclass
class FakeState:
    token_delay: float = 0.0
    first_token_delay: float = 0.0
    appliance: bool = True  # serve /admin/knobs
    api_key: str | None = None
    usage: bool = True  # send the usage chunk
    bodies: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # time.perf_counter() at each request
    in_flight: int = 0
    max_in_flight: int = 0
    cancelled: int = 0  # streams the client dropped before they ended
    history: list[dict[str, Any]] = field(default_factory=list)
    knob_change_on_request: bool = False  # log a knob change when a completion request arrives


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": None, "code": None}}, status_code=status)


def build_app(state: FakeState) -> Starlette:
    def authorized(request: Request) -> bool:
        return state.api_key is None or (
            request.headers.get("authorization") == f"Bearer {state.api_key}")

    async def models(request: Request):
        if not authorized(request):
            return _error(401, "bad key")
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def knobs(request: Request):
        if not state.appliance:
            return _error(404, "not found")
        return JSONResponse({"knobs": {"max_num_seqs": 8}, "version": 3, "iteration": 10,
                             "fixed": {"model": "fake-model"}})

    async def admin_state(request: Request):
        if not state.appliance:
            return _error(404, "not found")
        return JSONResponse({"running": state.in_flight, "waiting": 0, "replica_id": "fake-replica",
                             "model": "fake-model"})

    async def knob_history(request: Request):
        if not state.appliance:
            return _error(404, "not found")
        return JSONResponse({"data": state.history})

    async def completions(request: Request):
        return await generate(request, chat=False)

    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    async def generate(request: Request, chat: bool):
        if not authorized(request):
            return _error(401, "bad key")
        body = await request.json()
        state.bodies.append(body)
        state.arrivals.append(time.perf_counter())
        if state.knob_change_on_request:
            state.history.append({"version": len(state.history) + 1, "iteration": 0,
                                  "applied_at": time.time(), "old": {"max_num_seqs": 8},
                                  "new": {"max_num_seqs": 4}, "source": "admin"})
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        for code in (400, 429, 500):
            if prompt == f"http{code}":
                return _error(code, f"made-up {code}")
        n = body.get("max_tokens", 16)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{len(state.bodies)}"
        if chat:
            prompt_tokens = sum(len(m["content"].split()) for m in body["messages"])
        else:
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())

        def chunk(text: str, reason: str | None = None) -> str:
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text, "finish_reason": reason}
            return "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                          "model": "fake-model", "choices": [choice]}) + "\n\n"

        async def stream():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if prompt == "hang":
                    await asyncio.sleep(60)
                await asyncio.sleep(state.first_token_delay)
                yield ": keep-alive comment\n\n"
                if chat:
                    yield "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}) + "\n\n"
                for i in range(n):
                    if i:
                        await asyncio.sleep(state.token_delay)
                    if prompt == "drop" and i == 2:
                        return
                    if prompt == "huge-line" and i == 2:
                        yield chunk("x" * 600 * 1024)
                        continue
                    if prompt == "error-event" and i == 2:
                        yield "data: " + json.dumps({"error": {"message": "engine failed"}}) + "\n\n"
                        return
                    last = i == n - 1
                    reason = ("abort" if prompt == "abort" else "length") if last else None
                    yield chunk(f" {rid}:{i}" if chat else f" t{i}", reason)
                if state.usage:
                    yield "data: " + json.dumps({
                        "id": rid, "object": "text_completion", "choices": [],
                        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                  "total_tokens": prompt_tokens + n}}) + "\n\n"
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:
                state.cancelled += 1
                raise
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/admin/knobs", knobs),
        Route("/admin/knobs/history", knob_history),
        Route("/admin/state", admin_state),
    ])


@contextmanager
def serve(state: FakeState) -> Iterator[str]:
    """Run the fake server on a free 127.0.0.1 port; yield its base URL."""
    # proto=IPPROTO_TCP so asyncio sets TCP_NODELAY on accepted connections (with proto 0 it
    # does not, and Nagle + delayed ACK would hold small chunks back ~40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(build_app(state), log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
