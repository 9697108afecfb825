"""The OpenAPI 3.0 description of the server's routes (hand-written, served at /openapi.json).

Request schemas state what the server accepts exactly; responses list every status a route
can answer with its body shape.
"""

from __future__ import annotations

from typing import Any

from ..engine.knobs import MAX_BATCHED_TOKENS_LIMIT, MAX_NUM_SEQS_LIMIT, POLICIES
from ..engine.stats import FinishReason
from .protocol import MAX_STOP_STRINGS, RUN_ID_MAX_LEN, SOURCES, UNSUPPORTED_DEFAULTS


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("ErrorResponse"), description)


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    if "enum" in schema:  # an enum restricts null too unless it lists it
        schema = {**schema, "enum": [*schema["enum"], None]}
    return {**schema, "nullable": True}


def _json_type(value: Any) -> str:
    for kind, name in ((bool, "boolean"), (int, "number"), (str, "string"), (dict, "object"), (list, "array")):
        if isinstance(value, kind):
            return name
    raise TypeError(value)


def build_openapi(model: str, max_model_len: int, vocab_size: int, auth: bool) -> dict[str, Any]:
    """The schema for a server serving `model` with context `max_model_len`."""
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    stop = _nullable({"oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
    ]})
    sampling = {
        "model": _nullable({"type": "string", "enum": [model]}),
        "max_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": max_model_len}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 100}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1}),
        "seed": _nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1}),
        "stop": stop,
        "stop_token_ids": _nullable({"type": "array", "items": token_id}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "properties": {
            "include_usage": _nullable({"type": "boolean"})}, "description": "only with stream: true"}),
        "n": _nullable({"type": "integer", "enum": [1]}),
        "ignore_eos": _nullable({"type": "boolean"}),
        "min_tokens": _nullable({"type": "integer", "minimum": 0, "description": "at most max_tokens"}),
        "appliance_run_id": _nullable({"type": "string", "pattern": f"^[A-Za-z0-9_.:-]{{1,{RUN_ID_MAX_LEN}}}$"}),
        "appliance_source": _nullable({"type": "string", "enum": list(SOURCES)}),
        # OpenAI fields this server does not implement: only their default value is accepted
        **{name: _nullable({"type": _json_type(default), "enum": [default]})
           for name, default in UNSUPPORTED_DEFAULTS.items()},
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant"]},
            "content": {"oneOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
                    "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}},
            ]},
        },
    }
    prompt = {"oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": token_id, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": {"type": "array", "items": token_id, "minItems": 1}, "minItems": 1,
         "maxItems": 1},
    ]}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
        "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "required": ["cached_tokens"], "properties": {
            "cached_tokens": {"type": "integer", "description": "prompt tokens served from the prefix cache"}}}}}
    finish = _nullable({"type": "string", "enum": [r.value for r in FinishReason]})
    knob_props = {
        "max_num_seqs": {"type": "integer", "minimum": 1, "maximum": MAX_NUM_SEQS_LIMIT},
        "max_num_batched_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_BATCHED_TOKENS_LIMIT},
        "long_prefill_token_threshold": {"type": "integer", "minimum": 1, "maximum": MAX_BATCHED_TOKENS_LIMIT},
        "max_num_partial_prefills": {"type": "integer", "minimum": 1, "maximum": MAX_NUM_SEQS_LIMIT},
        "max_long_partial_prefills": {"type": "integer", "minimum": 1, "maximum": MAX_NUM_SEQS_LIMIT},
        "scheduling_policy": {"type": "string", "enum": list(POLICIES)},
        "enable_prefix_caching": {"type": "boolean"},
    }
    schemas = {
        "ErrorResponse": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": _nullable({"type": "string"}), "code": _nullable({"type": "string"})}}}},
        "KnobErrorResponse": {"allOf": [_ref("ErrorResponse"), {"type": "object", "required": ["errors"],
                                        "properties": {"errors": {"type": "object",
                                                                  "additionalProperties": {"type": "string"}}}}]},
        "ChatCompletionRequest": {"type": "object", "required": ["messages"], "properties": {
            "messages": {"type": "array", "items": message, "minItems": 1},
            "max_completion_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": max_model_len}),
            **sampling}, "additionalProperties": False},
        "CompletionRequest": {"type": "object", "required": ["prompt"], "properties": {"prompt": prompt, **sampling},
                              "additionalProperties": False},
        "ChatCompletion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                           "properties": {
            "id": {"type": "string"}, "object": {"type": "string", "enum": ["chat.completion"]},
            "created": {"type": "integer"}, "model": {"type": "string"}, "usage": usage,
            "choices": {"type": "array", "items": {"type": "object", "properties": {
                "index": {"type": "integer"}, "finish_reason": finish,
                "message": {"type": "object", "properties": {"role": {"type": "string"},
                                                             "content": {"type": "string"}}}}}}}},
        "Completion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                       "properties": {
            "id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion"]},
            "created": {"type": "integer"}, "model": {"type": "string"}, "usage": usage,
            "choices": {"type": "array", "items": {"type": "object", "properties": {
                "index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": finish}}}}},
        "ServerSentEvent": {
            "type": "object", "required": ["data"],
            "description": "one event: `data` is a JSON chunk (a completion chunk, the usage chunk, or an "
                           "error object) or `[DONE]`",
            "properties": {"data": {"type": "string"}, "event": {"type": "string"}}},
        "Knobs": {"type": "object", "properties": knob_props, "required": list(knob_props)},
        "KnobPatch": {"type": "object", "properties": knob_props, "additionalProperties": False},
        "KnobsView": {"type": "object", "required": ["knobs", "version", "iteration", "fixed"], "properties": {
            "knobs": _ref("Knobs"), "version": {"type": "integer"}, "iteration": {"type": "integer"},
            "fixed": {"type": "object", "properties": {
                "block_size": {"type": "integer"}, "num_blocks": {"type": "integer"},
                "kv_cache_tokens": {"type": "integer"}, "max_model_len": {"type": "integer"},
                "model": {"type": "string"}, "device": {"type": "string"}, "dtype": {"type": "string"}}}}},
        "KnobHistory": {"type": "object", "required": ["data"], "properties": {"data": {"type": "array", "items": {
            "type": "object", "required": ["version", "iteration", "applied_at", "old", "new", "source"],
            "properties": {"version": {"type": "integer"}, "iteration": {"type": "integer"},
                           "applied_at": {"type": "number"}, "old": {"type": "object"}, "new": {"type": "object"},
                           "source": {"type": "string"}}}}}},
        "EngineState": {"type": "object", "required": [
            "running", "waiting", "kv_blocks_used", "kv_blocks_total", "iteration", "uptime_s", "model", "device",
            "replica_id", "telemetry_rows_dropped"], "properties": {
            "status": {"type": "string"}, "running": {"type": "integer"}, "waiting": {"type": "integer"},
            "kv_blocks_used": {"type": "integer"}, "kv_blocks_free": {"type": "integer"},
            "kv_blocks_cached_free": {"type": "integer", "description": "free blocks still holding a cached prefix"},
            "kv_blocks_total": {"type": "integer"}, "iteration": {"type": "integer"},
            "knob_version": {"type": "integer"}, "uptime_s": {"type": "number"}, "model": {"type": "string"},
            "device": {"type": "string"}, "replica_id": {"type": "string"},
            "telemetry_rows_dropped": {"type": "integer"}, "in_flight": {"type": "integer"}}},
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"type": "string", "enum": ["list"]}, "data": {"type": "array", "items": {
                "type": "object", "required": ["id", "object"], "properties": {
                    "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                    "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}}}}},
    }
    unauthorized = {"401": _error("missing or wrong API key")} if auth else {}
    security = [{"bearer": []}] if auth else []

    def generation(request_schema: str, response_schema: str, summary: str) -> dict[str, Any]:
        return {"post": {
            "summary": summary,
            "security": security,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request_schema)}}},
            "responses": {
                "200": {"description": "the completion (JSON), or server-sent events when stream is true",
                        "content": {"application/json": {"schema": _ref(response_schema)},
                                    "text/event-stream": {"schema": _ref("ServerSentEvent")}}},
                "400": _error("invalid parameters, malformed JSON, or a prompt over the context length"),
                **unauthorized,
                "404": _error("unknown model"),
                "413": _error("request body too large"),
                "429": _error("the waiting queue is full"),
                "503": _error("draining, engine unavailable, or a model fault"),
            }}}

    def admin(method: str, schema: str, summary: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {method: {"summary": summary, "security": security, "responses": {
            "200": _json(_ref(schema), "ok"), **unauthorized, **(extra or {})}}}

    patch = admin("patch", "KnobsView", "change knobs (applied at the next iteration boundary)", {
        "400": _error("malformed JSON or a bad X-Appliance-Source header"),
        "413": _error("request body too large"),
        "422": _json(_ref("KnobErrorResponse"), "invalid knob values (nothing applied)"),
        "503": _error("engine unavailable"),
    })
    patch["patch"]["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref("KnobPatch")}}}
    patch["patch"]["parameters"] = [{"name": "X-Appliance-Source", "in": "header", "required": False,
                                     "schema": {"type": "string", "pattern": "^[a-z][a-z0-9_-]{0,31}$"}}]
    return {
        "openapi": "3.0.3",
        "info": {"title": "appliance", "version": "1", "description": f"OpenAI-compatible server for `{model}`"},
        "paths": {
            "/v1/chat/completions": generation("ChatCompletionRequest", "ChatCompletion", "chat completion"),
            "/v1/completions": generation("CompletionRequest", "Completion", "text completion"),
            "/v1/models": admin("get", "ModelList", "served models"),
            "/admin/knobs": {**admin("get", "KnobsView", "knobs in force"), **patch},
            "/admin/knobs/history": admin("get", "KnobHistory", "every knob change"),
            "/admin/state": admin("get", "EngineState", "engine state"),
            "/health": {"get": {"summary": "readiness", "responses": {
                "200": _json({"type": "object", "properties": {"status": {"type": "string"}}}, "ready"),
                "503": _json({"type": "object", "properties": {"status": {"type": "string"}}},
                             "loading or draining")}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "text exposition format", "content": {"text/plain": {
                    "schema": {"type": "string"}}}}}}},
        },
        "components": {"schemas": schemas, **({"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
                                              if auth else {})},
    }
