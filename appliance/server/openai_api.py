"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Failure semantics:
- Errors the engine reports before the first token (invalid request, queue full, draining)
  become HTTP errors, because the response has not started yet (the first output is awaited
  before the status line is sent).
- A request the engine ends with finish_reason "error" (a model fault) is answered, when not
  streaming, with HTTP 503 {"error": {"type": "server_error", "code": "engine_error"}} (the
  fault is transient and the request may be retried); when streaming, the last chunk carries
  finish_reason "error", then an event `data: {"error": {...}}` and `data: [DONE]` follow.
- A client that disconnects (streaming or not) has its request aborted at once: its KV blocks
  are free after the next iteration boundary.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from ..engine import (
    EngineDeadError,
    EngineDrainingError,
    FinishReason,
    InvalidRequestError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
)
from .errors import APIError, JSONResponse, ServerErrorCode, draining_error, error_object
from .protocol import (
    DEFAULT_CHAT_MAX_TOKENS_CAP,
    DEFAULT_COMPLETION_MAX_TOKENS,
    GenerationRequest,
    parse,
    read_json_object,
)
from .state import AppState


def _state(request: Request) -> AppState:
    return request.app.state.appliance


async def list_models(request: Request) -> JSONResponse:
    state = _state(request)
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": int(state.aeng.started_at),
        "owned_by": "appliance", "root": state.engine.model_name, "max_model_len": state.engine.max_model_len,
    }]})


async def chat_completions(request: Request):
    state = _state(request)
    state.check_admitting()
    req = parse(state.requests.chat, await read_json_object(request, state.config.max_body_bytes))
    state.check_model(req.model)
    messages = req.plain_messages()
    # the template costs per message too: many tiny messages also go off the event loop
    prompt_ids = await _tokenize(state, lambda: state.engine.encode_chat(messages),
                                 sum(len(m["content"]) + 64 for m in messages))
    return await _generate(request, state, req, prompt_ids, chat=True)


async def completions(request: Request):
    state = _state(request)
    state.check_admitting()
    req = parse(state.requests.completion, await read_json_object(request, state.config.max_body_bytes))
    state.check_model(req.model)
    prompt = req.the_prompt()
    if isinstance(prompt, list):
        prompt_ids = prompt
    else:
        prompt_ids = await _tokenize(state, lambda: state.engine.encode_prompt(prompt), len(prompt))
    return await _generate(request, state, req, prompt_ids, chat=False)


async def _tokenize(state: AppState, fn: Callable[[], list[int]], size: int) -> list[int]:
    try:
        return await state.run_tokenizer(fn, size)
    except Exception as exc:  # noqa: BLE001 - the input could not be tokenised: the client's problem
        raise APIError(400, f"could not build the prompt: {type(exc).__name__}: {exc}") from None


def _sampling_params(state: AppState, req: GenerationRequest, prompt_len: int, chat: bool) -> SamplingParams:
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        # Chat: vLLM's default (whatever context is left), capped. Completions: OpenAI's and
        # vLLM's default of 16. A prompt that fills the context gets 1, hence a clear 400.
        room = state.engine.max_model_len - prompt_len
        cap = DEFAULT_CHAT_MAX_TOKENS_CAP if chat else DEFAULT_COMPLETION_MAX_TOKENS
        max_tokens = max(1, min(cap, room))
    return req.sampling_params(max_tokens)


def _engine_error(exc: BaseException) -> APIError:
    if isinstance(exc, InvalidRequestError):
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, QueueFullError):
        return APIError(429, f"{exc}; retry later", code=ServerErrorCode.QUEUE_FULL, headers={"Retry-After": "1"})
    if isinstance(exc, EngineDrainingError):
        return draining_error()
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code=ServerErrorCode.ENGINE_UNAVAILABLE)
    return APIError(503, f"internal engine error: {type(exc).__name__}", code=ServerErrorCode.ENGINE_ERROR)


class DisconnectWatcher:
    """Waits for the client to go away (ASGI http.disconnect) and then calls `on_disconnect`."""

    def __init__(self, receive: Receive, on_disconnect: Callable[[], None]):
        self.disconnected = False
        self._on_disconnect = on_disconnect
        self._task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - a broken receive channel means the client is gone too
            pass
        self.disconnected = True
        self._on_disconnect()

    def stop(self) -> None:
        self._task.cancel()


class _Formatter:
    """Builds the response objects of one request (chat or text completion)."""

    def __init__(self, state: AppState, request_id: str, chat: bool, include_usage: bool):
        self.id = request_id
        self.chat = chat
        self.model = state.model_name
        self.created = int(time.time())
        self.include_usage = include_usage

    def chunk(self, text: str | None, finish_reason: FinishReason | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, final: RequestOutput) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": usage(final)}

    def complete(self, final: RequestOutput) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": final.text},
                      "logprobs": None, "finish_reason": final.finish_reason}
        else:
            choice = {"index": 0, "text": final.text, "logprobs": None, "finish_reason": final.finish_reason}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": usage(final)}


def usage(final: RequestOutput) -> dict[str, Any]:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.output_tokens,
            "total_tokens": final.prompt_tokens + final.output_tokens,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens}}


def _model_fault(final: RequestOutput) -> APIError:
    return APIError(503, f"the request failed inside the engine: {final.error or 'unknown error'}",
                    code=ServerErrorCode.ENGINE_ERROR, headers={"Retry-After": "1"})


async def _generate(request: Request, state: AppState, req: GenerationRequest, prompt_ids: list[int], chat: bool):
    params = _sampling_params(state, req, len(prompt_ids), chat)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    aeng = state.aeng
    watcher = DisconnectWatcher(request.receive, lambda: aeng.abort(request_id))
    outputs = aeng.generate(request_id, prompt_ids, params, source=req.source, run_id=req.appliance_run_id)
    state.inflight += 1
    itl = _ItlTimer(state)
    try:
        first = await outputs.__anext__()
        itl.seen(first)
    except BaseException as exc:
        state.inflight -= 1
        watcher.stop()
        await outputs.aclose()
        if isinstance(exc, Exception):
            raise _engine_error(exc) from None
        raise
    fmt = _Formatter(state, request_id, chat, req.include_usage)
    headers = {"X-Request-Id": request_id}
    if req.stream:
        events = _events(fmt, first, outputs, itl)
        return EventStream(events, watcher, lambda: _release(state), headers)
    final = first
    try:
        async for final in outputs:
            itl.seen(final)
    except Exception as exc:  # noqa: BLE001 - the engine went away mid-request
        raise _engine_error(exc) from None
    finally:
        _release(state)
        watcher.stop()
        await outputs.aclose()
    if final.finish_reason is FinishReason.ERROR:
        raise _model_fault(final)
    return JSONResponse(fmt.complete(final), headers=headers)


def _release(state: AppState) -> None:
    state.inflight -= 1


class _ItlTimer:
    """Observes the time between a request's successive output tokens."""

    def __init__(self, state: AppState):
        self.metrics = state.metrics
        self.last: float | None = None

    def seen(self, out: RequestOutput) -> None:
        n = len(out.new_token_ids)
        if not n:
            return
        now = time.perf_counter()
        if self.last is not None:
            self.metrics.observe_itl(now - self.last, n)
        self.last = now


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode("ascii") + b"\n\n"


async def _events(fmt: _Formatter, first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                  itl: _ItlTimer) -> AsyncIterator[bytes]:
    """SSE events: (chat) a role chunk, one chunk per new text piece, finish_reason on the last
    content chunk, then the usage chunk if asked for, then [DONE]."""
    try:
        if fmt.chat:
            yield _sse(fmt.chunk("", None, role=True))
        out = first
        while True:
            if out.finished:
                yield _sse(fmt.chunk(out.new_text if (out.new_text or not fmt.chat) else None, out.finish_reason))
                if out.finish_reason is FinishReason.ERROR:
                    yield _sse(_model_fault(out).body())
                if fmt.include_usage:
                    yield _sse(fmt.usage_chunk(out))
                break
            if out.new_text:
                yield _sse(fmt.chunk(out.new_text, None))
            try:
                out = await outputs.__anext__()
            except Exception as exc:  # noqa: BLE001 - the engine went away mid-stream
                yield _sse(fmt.chunk(None if fmt.chat else "", FinishReason.ERROR))
                yield _sse({"error": error_object(f"the engine stopped: {exc}", "server_error", None,
                                                  ServerErrorCode.ENGINE_UNAVAILABLE)})
                break
            itl.seen(out)
        yield b"data: [DONE]\n\n"
    finally:
        await outputs.aclose()


class EventStream:
    """A text/event-stream response that stops writing (and aborts the request, via the
    watcher) as soon as the client disconnects."""

    def __init__(self, events: AsyncIterator[bytes], watcher: DisconnectWatcher, on_close: Callable[[], None],
                 headers: dict[str, str]):
        self.events = events
        self.watcher = watcher
        self.on_close = on_close
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for chunk in self.events:
                if self.watcher.disconnected:
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not self.watcher.disconnected:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we were writing
            pass
        finally:
            self.watcher.stop()
            await self.events.aclose()  # aborts the request if it has not finished
            self.on_close()
