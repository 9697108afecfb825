"""Per-request sampling parameters, their validation, and the batched sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..numeric import is_int


class InvalidRequestError(ValueError):
    """A request the engine refuses before scheduling anything. `param` names the bad field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop (OpenAI's fields plus vLLM's ignore_eos/min_tokens)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    @property
    def greedy(self) -> bool:
        # like vLLM: a temperature this small is greedy (dividing by it would overflow to inf/NaN)
        return self.temperature < 1e-5

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise InvalidRequestError naming the first bad field; return self when valid."""
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= 100:
            raise InvalidRequestError(
                f"temperature must be a number between 0 and 100, got {self.temperature!r}", "temperature"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}", "top_k")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise InvalidRequestError(f"seed must be a 64-bit integer, got {self.seed!r}", "seed")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop must be a list of non-empty strings", "stop")
        if len(self.stop) > 16:
            raise InvalidRequestError(f"at most 16 stop strings, got {len(self.stop)}", "stop")
        if not isinstance(self.stop_token_ids, list) or not all(
            is_int(t) and 0 <= t < (vocab_size or 2**31) for t in self.stop_token_ids
        ):
            raise InvalidRequestError("stop_token_ids must be a list of valid token ids", "stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos must be a boolean", "ignore_eos")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an integer between 0 and max_tokens ({self.max_tokens}), "
                f"got {self.min_tokens!r}",
                "min_tokens",
            )
        return self


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
