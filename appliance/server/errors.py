"""OpenAI-shaped error bodies and a JSON response that can never fail to render.

Every error the server answers has the body {"error": {"message", "type", "param", "code"}}
(422 knob errors add "errors": {field: message}). Codes are enum members, never free text:
RequestErrorCode for refused requests (the engine's too), ServerErrorCode for the rest.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any, Mapping

from starlette.responses import Response

from ..engine.validation import RequestErrorCode

# Default error type per status, as OpenAI names them.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ServerErrorCode(str, Enum):
    """Error codes of everything but a refused request body (those are RequestErrorCode)."""

    REQUEST_TOO_LARGE = "request_too_large"
    INVALID_API_KEY = "invalid_api_key"
    MODEL_NOT_FOUND = "model_not_found"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    INVALID_KNOBS = "invalid_knobs"
    INVALID_AUTOPILOT = "invalid_autopilot"
    RUN_NOT_FOUND = "run_not_found"
    NO_MATCHING_ITERATIONS = "no_matching_iterations"  # nothing of the running configuration to simulate from
    NO_TELEMETRY_STORE = "no_telemetry_store"
    QUEUE_FULL = "queue_full"
    DRAINING = "draining"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    ENGINE_ERROR = "engine_error"
    INTERNAL_ERROR = "internal_error"
    REPLICA_NOT_FOUND = "replica_not_found"  # the fleet: ?replica=ID names no live replica
    REPLICA_UNAVAILABLE = "replica_unavailable"  # the fleet: the replica serving a request was lost


ErrorCode = RequestErrorCode | ServerErrorCode


class JSONResponse(Response):
    """JSON with ASCII escapes (any str renders, lone surrogates included) and no NaN."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """An error answered to the client; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: ErrorCode | None = None,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        return {"error": error_object(self.message, self.type, self.param, self.code), **self.extra}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_object(message: str, type: str, param: str | None = None, code: ErrorCode | None = None) -> dict[str, Any]:
    return {"message": message, "type": type, "param": param, "code": None if code is None else code.value}


def bad_request(message: str, param: str | None = None, code: ErrorCode | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def draining_error(cut: bool = False) -> APIError:
    """What a request that arrives while the server drains for shutdown gets, or (`cut`) one
    still running when the drain's grace ran out."""
    message = ("the server shut down before this request finished (its drain grace ran out)" if cut
               else "the server is shutting down and accepts no new requests")
    return APIError(503, message, code=ServerErrorCode.DRAINING, headers={"Retry-After": "1"})
