"""One request's state inside the engine.

The scheduler follows one rule: each iteration, a sequence's computed tokens catch up with its
total tokens (prompt + generated). A fresh prompt, a partial prefill, a decode and a sequence
resumed after preemption (computed tokens reset to 0) are all the same case.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .detokenizer import IncrementalDetokenizer
from .sampling import SamplingParams
from .stats import FinishReason, RequestStats

if TYPE_CHECKING:  # the simulator replays sequences without torch
    import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    source: str = "api"
    run_id: str | None = None
    arrival: float = field(default_factory=time.time)
    arrival_order: int = 0  # monotonically increasing admission ticket (for preemption order)

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of its full token blocks
    num_cached_blocks: int = 0  # leading blocks of block_table already in the prefix cache
    num_cached_tokens: int | None = None  # prompt tokens served from the cache at first admission
    finish_reason: FinishReason | None = None
    error: str | None = None
    preemptions: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    finished_at: float | None = None
    emitted_text_len: int = 0  # characters of output text already returned to the caller
    stats: RequestStats | None = None  # set when the request ends

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True while more than one token is still to be computed (prompt or recompute)."""
        return self.num_uncomputed > 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
