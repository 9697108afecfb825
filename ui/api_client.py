"""The dashboard's only way to the engine: the server's public HTTP API (httpx).

Admin calls are synchronous (short JSON requests); chat streams with an async client so a
Gradio cancel (the Stop button) closes the HTTP connection and the server aborts the request.
The API key, when set, stays here on the server side: it is never sent to the browser.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from appliance.bench.loadgen import iter_sse_data
from appliance.wire import SOURCE_HEADER

ADMIN_TIMEOUT_S = 10.0
SIMULATE_TIMEOUT_S = 120.0  # a replay of a long window takes seconds on a busy machine
# Chat replies stream for as long as generation takes; only connecting and each gap are bounded.
CHAT_TIMEOUT = httpx.Timeout(300.0, connect=10.0)


class ApiError(RuntimeError):
    """A failed API call, with the server's message and (for 422) the per-field errors."""

    def __init__(self, message: str, status: int | None = None, errors: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.errors = dict(errors or {})


def rejected_markdown(error: ApiError) -> str:
    """A refused change for the dashboard: the message, or each bad field with its reason."""
    if not error.errors:
        return f"**Rejected — nothing applied.** {error.message}"
    lines = ["**Rejected — nothing applied.**"]
    lines += [f"- `{field}`: {message}" for field, message in error.errors.items()]
    return "\n".join(lines)


def error_message(response: httpx.Response) -> str:
    """The message of an OpenAI-shaped error body, else the status line and some of the body."""
    try:
        message = response.json()["error"]["message"]
        if isinstance(message, str) and message:
            return message
    except (ValueError, KeyError, TypeError):
        pass
    return f"HTTP {response.status_code}: {response.text[:300] or response.reason_phrase}"


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    errors: dict[str, str] = {}
    try:
        payload = response.json()
        if isinstance(payload, dict) and isinstance(payload.get("errors"), dict):
            errors = {str(k): str(v) for k, v in payload["errors"].items()}
    except ValueError:
        pass
    raise ApiError(error_message(response), response.status_code, errors)


@dataclass
class ChatStats:
    """What one streamed chat reply measured on the dashboard's side."""

    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    ended: float | None = None
    chunks: int = 0
    completion_tokens: int | None = None  # from the usage chunk
    prompt_tokens: int | None = None  # from the usage chunk
    cached_tokens: int | None = None  # of the prompt, served from the prefix cache (usage chunk)
    finish_reason: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    @property
    def tokens_per_s(self) -> float | None:
        """Decode rate after the first token (tokens - 1 over the time since it)."""
        if self.first_token is None or self.ended is None or self.tokens < 2:
            return None
        span = self.ended - self.first_token
        return (self.tokens - 1) / span if span > 0 else None


class ApplianceAPI:
    """Client of one appliance server (`base_url` is its root, e.g. http://127.0.0.1:8000)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = ADMIN_TIMEOUT_S):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self._timeout = timeout_s
        self._client = httpx.Client(base_url=self.base_url, headers=self._headers(),
                                    timeout=timeout_s)

    def _headers(self) -> dict[str, str]:
        headers = {SOURCE_HEADER: "dashboard"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def close(self) -> None:
        self._client.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(f"cannot reach the server at {self.base_url}: {type(exc).__name__}: {exc}") from None
        _raise_for(response)
        try:
            return response.json()
        except ValueError:
            raise ApiError(f"{method} {path}: the reply is not JSON", response.status_code) from None

    # ------------------------------------------------------------------------------------ admin

    def knobs(self) -> dict[str, Any]:
        """GET /admin/knobs: {"knobs", "version", "iteration", "fixed"}."""
        return self._request("GET", "/admin/knobs")

    def patch_knobs(self, changes: dict[str, Any]) -> dict[str, Any]:
        """PATCH /admin/knobs once with `changes`; ApiError (with .errors) when rejected."""
        return self._request("PATCH", "/admin/knobs", json=changes)

    def autopilot(self) -> dict[str, Any]:
        """GET /admin/autopilot: {"enabled", "status", "spec", "moves", ...}."""
        return self._request("GET", "/admin/autopilot")

    def patch_autopilot(self, body: dict[str, Any]) -> dict[str, Any]:
        """PATCH /admin/autopilot ({"enabled", "spec"}); ApiError (with .errors) when rejected."""
        return self._request("PATCH", "/admin/autopilot", json=body)

    def simulate(self, knobs: dict[str, Any], *, run_id: str | None = None,
                 last_minutes: float | None = None) -> dict[str, Any]:
        """POST /admin/simulate: replay a recorded run (or the last N minutes) at its knobs and at
        `knobs`; ApiError when rejected (422 "no_matching_iterations": nothing to predict from)."""
        body: dict[str, Any] = {"knobs": knobs}
        body.update({"run_id": run_id} if run_id is not None else {"last_minutes": last_minutes})
        return self._request("POST", "/admin/simulate", json=body, timeout=SIMULATE_TIMEOUT_S)

    def knob_history(self) -> list[dict[str, Any]]:
        return self._request("GET", "/admin/knobs/history").get("data", [])

    def state(self) -> dict[str, Any]:
        """GET /admin/state: running, waiting, KV blocks, iteration, uptime, model, device..."""
        return self._request("GET", "/admin/state")

    async def model_id(self) -> str:
        """The first model GET /v1/models lists (async: handlers on the server's own event loop
        must not block it with a call back into the same server)."""
        async with httpx.AsyncClient(base_url=self.base_url, headers=self._headers(),
                                     timeout=self._timeout) as client:
            try:
                response = await client.get("/v1/models")
            except httpx.HTTPError as exc:
                raise ApiError(f"cannot reach the server at {self.base_url}: {exc}") from None
        _raise_for(response)
        data = response.json().get("data") or []
        if not data:
            raise ApiError("the server lists no model")
        return data[0]["id"]

    # ------------------------------------------------------------------------------------- chat

    async def stream_chat(
        self,
        messages: list[dict[str, str]],
        *,
        model: str,
        temperature: float,
        max_tokens: int,
        stats: ChatStats,
    ) -> AsyncIterator[str]:
        """Stream one chat completion; yield each text delta and fill `stats` as it goes.

        Closing the generator early (a cancelled Gradio event) closes the connection, which the
        server treats as an abort.
        """
        body = {
            "model": model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": temperature,
            "max_tokens": max_tokens,
            "appliance_source": "chat",
        }
        async with httpx.AsyncClient(base_url=self.base_url, headers=self._headers(),
                                     timeout=CHAT_TIMEOUT) as client:
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        _raise_for(response)
                    async for data in iter_sse_data(response.aiter_lines()):
                        if data.strip() == "[DONE]":
                            break
                        text = _take_chat_event(data, stats)
                        if text:
                            if stats.first_token is None:
                                stats.first_token = time.perf_counter()
                            stats.chunks += 1
                            yield text
            except httpx.HTTPError as exc:
                raise ApiError(f"chat request failed: {type(exc).__name__}: {exc}") from None
            finally:
                stats.ended = time.perf_counter()


def _take_chat_event(data: str, stats: ChatStats) -> str:
    """Apply one SSE event of a chat stream to `stats`; return its text delta ("" if none)."""
    try:
        event = json.loads(data)
    except ValueError:
        raise ApiError(f"the server sent a stream event that is not JSON: {data[:200]!r}") from None
    if not isinstance(event, dict):
        return ""
    if "error" in event:
        error = event["error"]
        raise ApiError(str(error.get("message") if isinstance(error, dict) else error))
    usage = event.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        stats.completion_tokens = usage["completion_tokens"]
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        stats.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            stats.cached_tokens = details["cached_tokens"]
    text = ""
    for choice in event.get("choices") or []:
        if isinstance(choice, dict):
            text += (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason"):
                stats.finish_reason = choice["finish_reason"]
    return text
