"""Per-request sampling parameters, their validation, and the batched sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Annotated

import torch
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


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A private RNG for a seeded request, so its samples do not depend on its batch mates."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % (2**64))
    return generator


@torch.inference_mode()
def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    banned: list[list[int]],
) -> list[int]:
    """Pick one token per row of `logits` ([n, vocab], float32).

    Greedy rows take the argmax. Other rows apply temperature, top-k and top-p and draw with the
    row's own generator (seeded requests) or the global RNG. `banned[i]` lists token ids row i
    may not emit now (EOS/stop ids while min_tokens is unmet).
    """
    for row, ids in enumerate(banned):
        if ids:
            logits[row, ids] = -math.inf
    chosen = torch.argmax(logits, dim=-1).tolist()
    for row, p in enumerate(params):
        if p.greedy:
            continue
        scores = logits[row] / p.temperature
        if p.top_k > 0 and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, -math.inf)
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < p.top_p
            keep[0] = True  # the most likely token always stays (a tiny top_p rounds to 0 in fp32)
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        chosen[row] = int(torch.multinomial(probs, 1, generator=generators[row]).item())
    return chosen
