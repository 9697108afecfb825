"""Reading OpenAI request bodies strictly, into one typed model per endpoint.

A body is read with a size limit and decoded as strict JSON (no NaN, bounded nesting, valid
Unicode), then validated by its endpoint's pydantic model, the model /openapi.json publishes.
The models are built per server (`build_request_models`) because some bounds depend on the
model served (context length, vocabulary); the per-field rules come from
`appliance.engine.sampling`, which checks SamplingParams with the same declarations. Types are
exact (a bool is not an integer, "5" is not a number); unknown fields are refused as OpenAI
refuses them ("Unrecognized request argument"), so a misspelt `max_token` is an error rather
than silently ignored; known fields the appliance cannot honour are accepted only at their
default; every failure is an APIError(400) naming the field, with a code.
"""

from __future__ import annotations

import json
import math
import re
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      ValidationError, ValidationInfo, WithJsonSchema, create_model)
from pydantic_core import PydanticCustomError
from starlette.requests import ClientDisconnect, Request

from ..engine.chat import Messages
from ..engine.sampling import (MAX_STOP_STRINGS, MaxTokens, MinTokens, NonEmptyStr, SamplingParams, Seed,
                               StopStrings, Temperature, TokenId, TopK, TopP)
from ..engine.validation import Location, RequestErrorCode, problems, show
from .errors import APIError, ServerErrorCode, bad_request

MAX_JSON_DEPTH = 32
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
    return APIError(413, f"request body too large (limit {limit} bytes)", code=ServerErrorCode.REQUEST_TOO_LARGE,
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


# -- the request models -----------------------------------------------------------------------------
def _only_default(default: Any) -> Any:
    """A field accepted only at `default` (null counts as not given); 0.0 is 0 but false is not."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if value is not None and not (value == default and isinstance(value, bool) == isinstance(default, bool)):
            raise PydanticCustomError(RequestErrorCode.UNSUPPORTED.value,
                                      "{name} other than {default} is not supported by this server",
                                      {"name": info.field_name, "default": show(default)})
        return value

    return Annotated[Any, AfterValidator(check), WithJsonSchema({"enum": [default, None]})]


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = None


def _prompt(token: Any, ids: str = "token ids") -> Any:
    """A completion's one prompt: text or token ids, alone or in a list of one."""
    tokens = Annotated[list[token], Field(min_length=1)]
    one = Field(min_length=1, max_length=1)
    return Annotated[NonEmptyStr | tokens | Annotated[list[NonEmptyStr], one] | Annotated[list[tokens], one],
                     Field(description=f"a non-empty string, a list of {ids}, or a list holding one of those")]


class GenerationRequest(BaseModel):
    """What chat and text completions share. `build_request_models` narrows it to the model
    served (its name, context length and vocabulary)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: NonEmptyStr | StopStrings | None = Field(
        None, description=f"a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings")
    stop_token_ids: list[TokenId] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    ignore_eos: StrictBool | None = None
    min_tokens: MinTokens | None = None
    appliance_source: Literal[SOURCES] | None = None
    appliance_run_id: Annotated[StrictStr, Field(pattern=rf"^[A-Za-z0-9_.:-]{{1,{RUN_ID_MAX_LEN}}}$")] | None = None
    # OpenAI's fields this server cannot honour: accepted only at their default
    n: _only_default(1) = None
    presence_penalty: _only_default(0) = None
    frequency_penalty: _only_default(0) = None
    repetition_penalty: _only_default(1) = None
    logit_bias: _only_default({}) = None
    logprobs: _only_default(False) = None
    top_logprobs: _only_default(0) = None
    echo: _only_default(False) = None
    best_of: _only_default(1) = None
    suffix: _only_default("") = None
    tools: _only_default([]) = None
    functions: _only_default([]) = None
    response_format: _only_default({"type": "text"}) = None
    # OpenAI's bookkeeping fields: accepted, without effect on the generated text
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None
    tool_choice: Any = None

    @property
    def requested_max_tokens(self) -> int | None:
        """max_tokens as asked; None: the endpoint's default applies."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def source(self) -> str:
        return self.appliance_source or "api"

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters: the fields given, SamplingParams' defaults for the others."""
        names = ("temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "min_tokens")
        given = {name: value for name in names if (value := getattr(self, name)) is not None}
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(max_tokens=max_tokens, stop=stop or [], **given)


class ChatCompletionBase(GenerationRequest):
    messages: Messages
    max_completion_tokens: StrictInt | None = Field(None, description="replaces max_tokens; checked as max_tokens")

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the older max_tokens (both are checked)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else super().requested_max_tokens

    def plain_messages(self) -> list[dict[str, str]]:
        return [m.plain() for m in self.messages]


class CompletionBase(GenerationRequest):
    prompt: _prompt(TokenId)

    def the_prompt(self) -> str | list[int]:
        """The one prompt, text or token ids (a list holding one is unwrapped)."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)):
            return self.prompt[0]
        return self.prompt


RequestT = TypeVar("RequestT", bound=GenerationRequest)


@dataclass(frozen=True)
class RequestModels:
    """The request models of one server, bounded by the model it serves."""

    chat: type[ChatCompletionBase]
    completion: type[CompletionBase]


def build_request_models(served_model: str, max_model_len: int, vocab_size: int) -> RequestModels:
    """Chat and completion request models for a server serving `served_model`, with context
    `max_model_len`, over a vocabulary of `vocab_size` tokens."""
    token = Annotated[TokenId, Field(lt=vocab_size)]
    narrowed: dict[str, Any] = {
        "model": (Annotated[StrictStr, Field(json_schema_extra={"enum": [served_model]})] | None, None),
        "max_tokens": (Annotated[MaxTokens, Field(le=max_model_len)] | None, None),
        "stop_token_ids": (list[token] | None, Field(None, description=f"a list of token ids below {vocab_size}")),
    }
    prompt = (_prompt(token, f"token ids below {vocab_size}"), ...)
    return RequestModels(
        chat=create_model("ChatCompletionRequest", __base__=ChatCompletionBase, **narrowed),
        completion=create_model("CompletionRequest", __base__=CompletionBase, **narrowed, prompt=prompt),
    )


def parse(model: type[RequestT], body: dict[str, Any]) -> RequestT:
    """Validate `body`; APIError(400) naming the first bad field (all unknown ones together)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        descriptions = {name: f.description for name, f in model.model_fields.items() if f.description}
        found = problems(exc, param_of=lambda loc: _param(model, loc), descriptions=descriptions)
    unknown = sorted(p.param for p in found if p.code is RequestErrorCode.UNRECOGNIZED)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0],
                          RequestErrorCode.UNRECOGNIZED)
    raise bad_request(found[0].message, found[0].param, found[0].code)


def _param(model: type[BaseModel], loc: Location) -> str:
    """The field an error is reported on: a top-level field, or `outer.inner` inside a nested
    object (stream_options.include_usage); list items report their list."""
    field = model.model_fields.get(str(loc[0])) if loc else None
    if field is None:
        return str(loc[0]) if loc else "body"
    nested = [t for t in typing.get_args(field.annotation) or (field.annotation,)
              if isinstance(t, type) and issubclass(t, BaseModel)]
    if nested and len(loc) > 1 and isinstance(loc[1], str) and loc[1] in nested[0].model_fields:
        return f"{loc[0]}.{loc[1]}"
    return str(loc[0])
