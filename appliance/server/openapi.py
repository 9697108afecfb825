"""The OpenAPI 3.1 description of the server's routes, served at /openapi.json.

Request bodies are the JSON schemas of the models that validate them (the endpoints' request
models, the knobs); responses list every status a route can answer with its body shape.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from ..engine.knobs import Knobs
from ..engine.stats import FinishReason
from ..wire import REASON_HEADER, SOURCE_HEADER
from .admin import AutopilotPatch
from .autopilot_policy import TARGETS, TUNABLE
from .protocol import RequestModels
from .simulate import SimulateRequest

REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("ErrorResponse"), description)


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _model_schemas(models: RequestModels) -> dict[str, Any]:
    """Components for the request models, the knobs, the simulation request and the autopilot's
    switch (nested models included), and KnobPatch: any subset of the knobs."""
    _, top = models_json_schema([(models.chat, "validation"), (models.completion, "validation"),
                                 (Knobs, "serialization"), (SimulateRequest, "validation"),
                                 (AutopilotPatch, "validation")], ref_template=REF)
    schemas = top["$defs"]
    knobs = schemas["Knobs"]
    schemas["KnobPatch"] = {"type": "object", "additionalProperties": False, "properties": {
        name: {k: v for k, v in prop.items() if k != "default"} for name, prop in knobs["properties"].items()}}
    simulate = schemas["SimulateRequest"]  # what its validator adds: exactly one source, knobs by name
    simulate["oneOf"] = [{"required": ["run_id"], "properties": {"run_id": {"type": "string"}}},
                         {"required": ["last_minutes"], "properties": {"last_minutes": {"type": "number"}}}]
    simulate["properties"]["knobs"] = {**_ref("KnobPatch"), "description": simulate["properties"]["knobs"].get(
        "description", "")}
    spec = schemas["AutopilotPatch"]["properties"]["spec"]  # the names parse_spec knows, in both forms
    names = "|".join((*TARGETS, *TUNABLE))
    spec["anyOf"] = [
        {"type": "string", "pattern": f"^\\s*({names})=[^,]+(,\\s*({names})=[^,]+)*$"},
        {"type": "object", "additionalProperties": False, "required": ["targets"], "properties": {
            "targets": {"type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
                name: {"type": "number", "exclusiveMinimum": 0, "description": "seconds"} for name in TARGETS}},
            "bounds": {"type": "object", "additionalProperties": False, "properties": {
                name: {"type": "array", "minItems": 2, "maxItems": 2, "description": "[lo, hi], lo <= hi",
                       "items": {k: v for k, v in knobs["properties"][name].items() if k in ("type", "minimum",
                                                                                              "maximum")}}
                for name in TUNABLE}}}},
        {"type": "null"},
    ]
    return schemas


def build_openapi(models: RequestModels, model: str, auth: bool) -> dict[str, Any]:
    """The schema for a server serving `model`, whose requests `models` validate."""
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
        "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "required": ["cached_tokens"], "properties": {
            "cached_tokens": {"type": "integer", "description": "prompt tokens served from the prefix cache"}}}}}
    finish = _nullable({"type": "string", "enum": [r.value for r in FinishReason]})
    schemas = {
        **_model_schemas(models),
        "ErrorResponse": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": _nullable({"type": "string"}), "code": _nullable({"type": "string"})}}}},
        "KnobErrorResponse": {"allOf": [_ref("ErrorResponse"), {"type": "object", "required": ["errors"],
                                        "properties": {"errors": {"type": "object",
                                                                  "additionalProperties": {"type": "string"}}}}]},
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
        "KnobsView": {"type": "object", "required": ["knobs", "version", "iteration", "fixed"], "properties": {
            "knobs": _ref("Knobs"), "version": {"type": "integer"}, "iteration": {"type": "integer"},
            "fixed": {"type": "object", "properties": {
                "block_size": {"type": "integer"}, "num_blocks": {"type": "integer"},
                "kv_cache_tokens": {"type": "integer"}, "max_model_len": {"type": "integer"},
                "model": {"type": "string"}, "device": {"type": "string"}, "dtype": {"type": "string"},
                "cpu_kernels": {"type": "boolean"}, "threads": {"type": "integer"}}}}},
        "KnobHistory": {"type": "object", "required": ["data"], "properties": {"data": {"type": "array", "items": {
            "type": "object", "required": ["version", "iteration", "applied_at", "old", "new", "source"],
            "properties": {"version": {"type": "integer"}, "iteration": {"type": "integer"},
                           "applied_at": {"type": "number"}, "old": {"type": "object"}, "new": {"type": "object"},
                           "source": {"type": "string"}, "reason": {"type": ["string", "null"]},
                           "prediction": {"type": ["object", "null"]}}}}}},
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
        "Simulation": {"type": "object", "required": ["object", "source", "model", "baseline", "predicted",
                                                      "knobs"], "properties": {
            "object": {"type": "string", "enum": ["simulation"]}, "source": {"type": "object"},
            "running_engine": {"type": "string"}, "model": {"type": "object"},
            "recorded": _nullable({"type": "object"}), "recorded_by": {"type": "string", "enum": ["client", "server"]},
            "baseline": {"type": "object"}, "predicted": {"type": "object"}, "knobs": _ref("Knobs"),
            "elapsed_s": {"type": "number"}}},
        "Autopilot": {"type": "object", "required": ["enabled", "status", "spec", "moves"], "properties": {
            "enabled": {"type": "boolean"}, "status": {"type": "string"}, "error": _nullable({"type": "string"}),
            "spec": _nullable({"type": "object", "properties": {"targets": {"type": "object"},
                                                                 "bounds": {"type": "object"}}}),
            "window_s": {"type": "number"}, "cooldown_s": {"type": "number"}, "manual_hold_s": {"type": "number"},
            "simulator": {"type": "boolean", "description": "moves are chosen with the what-if simulator"},
            "last_decision": _nullable({"type": "object"}),
            "moves": {"type": "array", "items": {"type": "object"}}}},
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
        "400": _error("malformed JSON or a bad X-Appliance-Source / X-Appliance-Reason header"),
        "413": _error("request body too large"),
        "422": _json(_ref("KnobErrorResponse"), "invalid knob values (nothing applied)"),
        "503": _error("engine unavailable"),
    })
    simulate = admin("post", "Simulation", "predict a knob change by replaying a run or the last minutes "
                     "(nothing applied)", {
        "400": _error("malformed JSON, a bad field, an unknown run, a run that cannot be replayed, or invalid "
                      "knobs (then with `errors`: each bad knob and why)"),
        "413": _error("request body too large"),
        "422": _error("no iterations of the running configuration to predict from"),
        "409": _error("the server runs without a telemetry store"),
    })
    autopilot = {**admin("get", "Autopilot", "the SLO autopilot: switch, targets, status and recent moves"),
                 **admin("patch", "Autopilot", "switch the autopilot, or give it targets and knob bounds", {
                     "400": _error("malformed JSON"),
                     "413": _error("request body too large"),
                     "422": _json(_ref("KnobErrorResponse"), "invalid settings (nothing changed)"),
                 })}
    autopilot["patch"]["requestBody"] = {"required": True, "content": {"application/json": {
        "schema": _ref("AutopilotPatch")}}}
    simulate["post"]["requestBody"] = {"required": True, "content": {"application/json": {
        "schema": _ref("SimulateRequest")}}}
    patch["patch"]["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref("KnobPatch")}}}
    patch["patch"]["parameters"] = [{"name": SOURCE_HEADER, "in": "header", "required": False,
                                     "schema": {"type": "string", "pattern": "^[a-z][a-z0-9_-]{0,31}$"}},
                                    {"name": REASON_HEADER, "in": "header", "required": False,
                                     "schema": {"type": "string", "maxLength": 500}}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "appliance", "version": "1", "description": f"OpenAI-compatible server for `{model}`"},
        "paths": {
            "/v1/chat/completions": generation("ChatCompletionRequest", "ChatCompletion", "chat completion"),
            "/v1/completions": generation("CompletionRequest", "Completion", "text completion"),
            "/v1/models": admin("get", "ModelList", "served models"),
            "/admin/knobs": {**admin("get", "KnobsView", "knobs in force"), **patch},
            "/admin/knobs/history": admin("get", "KnobHistory", "every knob change"),
            "/admin/state": admin("get", "EngineState", "engine state"),
            "/admin/simulate": simulate,
            "/admin/autopilot": autopilot,
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
