"""Reading and validating OpenAI request bodies, strictly.

Types are checked exactly (a bool is not an integer, NaN and infinities are refused), unknown
fields are refused as OpenAI refuses them ("Unrecognized request argument"), so a misspelt
`max_token` is an error rather than silently ignored; known fields the appliance cannot honour
are refused unless they hold their default, and every failure is an APIError(400) naming the
field.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect, Request

from ..engine.chat import validate_messages
from ..numeric import is_int
from .errors import APIError, bad_request

MAX_JSON_DEPTH = 32
MAX_STOP_STRINGS = 16
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS_CAP = 1024  # chat default: what is left of the context, at most this
SOURCES = ("api", "chat", "loadtest")
RUN_ID_MAX_LEN = 36
_DRAIN_EXTRA_BYTES = 8 << 20  # read (and drop) this much of an oversized body before answering 413


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 when Content-Length or the bytes received exceed `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not re.fullmatch(r"[0-9]{1,20}", declared):
            raise bad_request("invalid Content-Length header")
        if int(declared) > limit + _DRAIN_EXTRA_BYTES:
            raise _too_large(limit, headers={"Connection": "close"})
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit + _DRAIN_EXTRA_BYTES:
                raise _too_large(limit, headers={"Connection": "close"})
            if size <= limit:
                chunks.append(chunk)
    except ClientDisconnect:
        raise bad_request("the client disconnected while sending the body") from None
    if size > limit:
        raise _too_large(limit)
    return b"".join(chunks)


def _too_large(limit: int, headers: dict[str, str] | None = None) -> APIError:
    return APIError(413, f"request body too large (limit {limit} bytes)", code="request_too_large",
                    headers=headers)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> Any:
    """Decode a UTF-8 JSON document; 400 for anything else (NaN, deep nesting, lone surrogates)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, integers too long to convert
        raise bad_request(f"malformed JSON body: {exc}") from None
    _check_tree(value)
    return value


def _check_tree(value: Any) -> None:
    """Bound the nesting depth; refuse strings that are not valid Unicode (lone surrogates)
    and numbers that overflowed to infinity (1e999)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise bad_request(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            children = list(item.items()) if isinstance(item, dict) else [(None, v) for v in item]
            for key, child in children:
                if key is not None:
                    _check_text(key)
                stack.append((child, depth + 1))
        elif isinstance(item, str):
            _check_text(item)
        elif isinstance(item, float) and not math.isfinite(item):
            raise bad_request("numbers must be finite")


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("strings must be valid Unicode (no lone surrogate escapes)") from None


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    body = parse_json(await read_body(request, limit))
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


# -- field readers ------------------------------------------------------------------------------
def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def opt_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and not is_int(value):
        raise bad_request(f"{name} must be an integer, got {_show(value)}", name)
    return value


def opt_number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is not None and not _is_number(value):
        raise bad_request(f"{name} must be a number, got {_show(value)}", name)
    return value


def opt_bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {_show(value)}", name)
    return value


def opt_str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{name} must be a string, got {_show(value)}", name)
    return value


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Fields OpenAI defines that the appliance does not implement: accepted only at their default.
UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "logit_bias": {},
    "logprobs": False,
    "top_logprobs": 0,
    "echo": False,
    "best_of": 1,
    "suffix": "",
    "tools": [],
    "functions": [],
    "response_format": {"type": "text"},
}


# Accepted without effect: OpenAI bookkeeping fields that do not change the generated text.
INERT_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "tool_choice"})
COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream",
    "stream_options", "n", "ignore_eos", "min_tokens", "appliance_source", "appliance_run_id",
}) | INERT_FIELDS | frozenset(UNSUPPORTED_DEFAULTS)
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}


def _refuse_unknown(body: dict, known: frozenset[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0],
                          code="unrecognized_argument")


def _is_default(value: Any, default: Any) -> bool:
    return value == default and isinstance(value, bool) == isinstance(default, bool)


@dataclass
class GenerationRequest:
    """A validated chat or completion request (prompt not yet tokenised)."""

    model: str | None
    max_tokens: int | None  # None: the endpoint's default
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    min_tokens: int
    stream: bool
    include_usage: bool
    source: str
    run_id: str | None
    messages: list[dict] | None = None  # chat
    prompt_text: str | None = None  # completions, text prompt
    prompt_ids: list[int] | None = field(default=None, repr=False)  # completions, token ids


def _common(body: dict, max_tokens: int | None) -> dict[str, Any]:
    for name, default in UNSUPPORTED_DEFAULTS.items():
        value = body.get(name)
        if value is not None and not _is_default(value, default):
            raise bad_request(f"{name} is not supported by this server", name, code="unsupported_parameter")
    n = opt_int(body, "n")
    if n is not None and n != 1:
        raise bad_request(f"only n=1 is supported, got {_show(n)}", "n")
    model = opt_str(body, "model")
    stream = bool(opt_bool(body, "stream"))
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:  # like vLLM's, but without a stream it is simply unused
        if not isinstance(stream_options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        usage = stream_options.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise bad_request(f"stream_options.include_usage must be a boolean, got {_show(usage)}",
                              "stream_options.include_usage")
        include_usage = stream and bool(usage)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is None:
        stop_token_ids = []
    if not isinstance(stop_token_ids, list) or not all(is_int(t) for t in stop_token_ids):
        raise bad_request("stop_token_ids must be a list of integers", "stop_token_ids")
    source = opt_str(body, "appliance_source") or "api"
    if source not in SOURCES:
        raise bad_request(f"appliance_source must be one of {', '.join(SOURCES)}, got {_show(source)}",
                          "appliance_source")
    run_id = opt_str(body, "appliance_run_id")
    if run_id is not None and not re.fullmatch(r"[A-Za-z0-9_.:-]{1,%d}" % RUN_ID_MAX_LEN, run_id):
        raise bad_request(f"appliance_run_id must be 1-{RUN_ID_MAX_LEN} characters of [A-Za-z0-9_.:-]",
                          "appliance_run_id")
    temperature = opt_number(body, "temperature")
    top_p = opt_number(body, "top_p")
    return dict(
        model=model,
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=opt_int(body, "top_k") or 0,
        seed=opt_int(body, "seed"),
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=bool(opt_bool(body, "ignore_eos")),
        min_tokens=opt_int(body, "min_tokens") or 0,
        stream=stream,
        include_usage=include_usage,
        source=source,
        run_id=run_id,
    )


def parse_chat(body: dict, max_model_len: int) -> GenerationRequest:
    """max_completion_tokens wins over the older max_tokens; both are checked when both are given."""
    _refuse_unknown(body, CHAT_FIELDS)
    max_tokens = opt_int(body, "max_completion_tokens")
    legacy = opt_int(body, "max_tokens")
    if max_tokens is None:
        max_tokens = legacy
    elif legacy is not None and not 1 <= legacy <= max_model_len:
        raise bad_request(f"max_tokens must be between 1 and {max_model_len}, got {legacy}", "max_tokens")
    if "messages" not in body:
        raise bad_request("messages is required", "messages")
    try:
        messages = validate_messages(body["messages"])
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    return GenerationRequest(messages=messages, **_common(body, max_tokens))


def parse_completion(body: dict) -> GenerationRequest:
    _refuse_unknown(body, COMPLETION_FIELDS)
    max_tokens = opt_int(body, "max_tokens")
    if "prompt" not in body:
        raise bad_request("prompt is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise bad_request(f"only one prompt per request is supported, got {len(prompt)}", "prompt")
        prompt = prompt[0]
    text: str | None = None
    ids: list[int] | None = None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and all(is_int(t) for t in prompt):
        ids = prompt
    else:
        raise bad_request("prompt must be a string, a list of token ids, or a list holding one of those",
                          "prompt")
    if (text is not None and not text) or (ids is not None and not ids):
        raise bad_request("the prompt is empty", "prompt")
    return GenerationRequest(prompt_text=text, prompt_ids=ids, **_common(body, max_tokens))
