"""Per-request sampling parameters and their validation (no torch here: the simulator replays
requests with them; the batched sampler is `sampler`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Annotated

from pydantic import Field, StrictBool, StrictInt, StrictStr, TypeAdapter, ValidationError

from .validation import RequestErrorCode, problems

MAX_STOP_STRINGS = 16

# Each request field's rule, declared once: the engine checks SamplingParams with these, and the
# server's request models (hence its OpenAPI document) are built from them.
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
TokenId = Annotated[StrictInt, Field(ge=0)]
MaxTokens = Annotated[StrictInt, Field(ge=1)]
Temperature = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=0, le=100)]
TopP = Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0, le=1)]
TopK = Annotated[StrictInt, Field(ge=-1, description="-1 or 0: no top-k cut")]
Seed = Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)]
StopStrings = Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)]
MinTokens = Annotated[StrictInt, Field(ge=0, description="at most max_tokens")]


class InvalidRequestError(ValueError):
    """A request the engine refuses before scheduling anything. `param` names the bad field,
    `code` says why."""

    def __init__(self, message: str, param: str | None = None,
                 code: RequestErrorCode = RequestErrorCode.INVALID_VALUE):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (OpenAI's fields plus vLLM's ignore_eos/min_tokens)."""

    max_tokens: MaxTokens = 16
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Seed | None = None
    stop: StopStrings = field(default_factory=list)
    stop_token_ids: list[TokenId] = field(default_factory=list)
    ignore_eos: StrictBool = False
    min_tokens: MinTokens = 0

    @property
    def greedy(self) -> bool:
        # like vLLM: a temperature this small is greedy (dividing by it would overflow to inf/NaN)
        return self.temperature < 1e-5

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise InvalidRequestError naming the first bad field; return self when valid."""
        try:
            _FIELDS.validate_python({f.name: getattr(self, f.name) for f in fields(self)})
        except ValidationError as exc:
            first = problems(exc)[0]
            raise InvalidRequestError(first.message, first.param, first.code) from None
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})", "min_tokens")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be token ids below {vocab_size}", "stop_token_ids")
        return self


_FIELDS = TypeAdapter(SamplingParams)
