"""Decides, each iteration, which sequences run and how many of their tokens are computed.

One rule covers every case: a sequence's computed tokens catch up with its total tokens, at most
`long_prefill_token_threshold` per iteration, all sequences together at most
`max_num_batched_tokens`. Order: decodes of running sequences first, then unfinished prefills,
then waiting requests FCFS (short prompts may overtake long ones when the long-prefill slots are
taken). When blocks run out, the most recently arrived running sequence is preempted by
recompute: its blocks are freed and it goes back to the head of the waiting queue.

Each iteration also records what held traffic back, counted where the decisions are taken (no
extra pass): every request still waiting after admission is counted under the one limit that
stopped it (`HoldCause`; a long prompt skipped for a shorter one counts under
max_long_partial_prefills), and prefill tokens that fitted the budget but not the chunk size are
counted as deferred. Continuous policy only; preemptions are `preempted` itself.

Prefix caching: at admission a sequence takes the cached blocks of its longest cached prefix
(BlockManager.match_prefix) and starts with those tokens computed, so budget, chunking and the
partial/long-prefill limits all see only its uncached tokens; a preempted sequence re-matches
its own blocks when it comes back. The `enable_prefix_caching` knob is applied to the block
manager at the start of each schedule, and blocks filled by the last iteration are cached then.

The `static` policy is the classic padded batch kept for A/B comparison: a batch is admitted only
when none is running, and members that finish stay in it as padding rows until the last one ends.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..records import HoldCause
from .block_manager import BlockManager
from .knobs import Knobs
from .sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int
    is_prefill: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    padding_rows: int = 0  # static policy: finished members still computed as padding
    held: dict[HoldCause, int] = field(default_factory=dict)  # waiting requests by what held them
    chunk_deferred_tokens: int = 0  # prefill tokens within the budget left for later by the chunk size
    prefix_cache_queries: int = 0  # tokens of the sequences admitted now, looked up in the cache
    prefix_cache_hits: int = 0  # of which served from the cache (not computed)

    def hold(self, cause: HoldCause, count: int) -> None:
        if count:
            self.held[cause] = self.held.get(cause, 0) + count

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """`clock` stamps `first_scheduled` (wall clock by default; the simulator passes its virtual
    clock)."""

    def __init__(self, block_manager: BlockManager, knobs: Knobs, clock: Callable[[], float] = time.time):
        self.block_manager = block_manager
        self.knobs = knobs
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._static_finished_members = 0  # padding rows of the current static batch

    # -- queue management ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished or aborted) and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            if self.knobs.scheduling_policy == "static" and self.running:
                self._static_finished_members += 1
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.free(seq)
        if not self.running:
            self._static_finished_members = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the schedule ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        knobs = self.knobs
        out = SchedulerOutput()
        budget = knobs.max_num_batched_tokens
        chunk = knobs.long_prefill_token_threshold
        static = knobs.scheduling_policy == "static"
        self.block_manager.set_caching(knobs.enable_prefix_caching)
        for seq in self.running:  # blocks filled by the last iteration join the cache
            self.block_manager.cache_full_blocks(seq)
        if static and not self.running:
            self._form_static_batch(out)
        decodes = [s for s in self.running if not _needs_prefill(s)]
        prefills = [s for s in self.running if _needs_prefill(s)]

        for seq in decodes:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted as a victim earlier in this loop
                continue
            granted, released = self._reserve(seq, 1, out)
            budget += released
            if granted:
                out.scheduled.append(ScheduledSeq(seq, 1, is_prefill=False))
                budget -= 1

        for seq in prefills:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue
            wanted = min(seq.num_uncomputed, budget)
            n, released = self._reserve(seq, min(wanted, chunk), out)
            budget += released
            if n:
                out.chunk_deferred_tokens += wanted - min(wanted, chunk)
                out.scheduled.append(ScheduledSeq(seq, n, is_prefill=True))
                budget -= n

        if static:
            out.padding_rows = self._static_finished_members
        elif not out.preempted:
            self._admit(out, budget, chunk)
        else:  # a preemption this iteration: nothing is admitted, for lack of KV blocks
            out.hold(HoldCause.KV_BLOCKS, len(self.waiting))
        now = self.clock()
        for item in out.scheduled:
            if item.seq.first_scheduled is None:
                item.seq.first_scheduled = now
        return out

    def _form_static_batch(self, out: SchedulerOutput) -> None:
        """Static policy: take up to max_num_seqs waiting requests whose prompts fit in the cache.

        Their prompts are then prefilled (within the token budget) and they decode together;
        nothing joins until every member is done.
        """
        bm = self.block_manager
        reserved = 0  # blocks the members admitted so far still need
        while self.waiting and len(self.running) < self.knobs.max_num_seqs:
            seq = self.waiting[0]
            self._match(seq)
            need = -(-seq.num_tokens // bm.block_size) - len(seq.block_table)
            if need > bm.num_free_blocks - reserved:
                self._unmatch(seq)
                break
            reserved += need
            self.waiting.popleft()
            self._count_admission(seq, out)
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _admit(self, out: SchedulerOutput, budget: int, chunk: int) -> None:
        """Continuous policy: admit waiting requests FCFS into the leftover budget."""
        knobs = self.knobs
        partial = sum(1 for s in self.running if _needs_prefill(s))
        long_partial = sum(1 for s in self.running if _needs_prefill(s) and s.num_uncomputed > chunk)
        skipped: list[Sequence] = []
        stop: HoldCause | None = None
        while self.waiting:
            if budget <= 0:
                stop = HoldCause.TOKEN_BUDGET
            elif len(self.running) >= knobs.max_num_seqs:
                stop = HoldCause.MAX_NUM_SEQS
            elif partial >= knobs.max_num_partial_prefills:
                stop = HoldCause.PARTIAL_PREFILLS
            if stop is not None:
                break
            seq = self.waiting.popleft()
            self._match(seq)
            is_long = seq.num_uncomputed > chunk
            if is_long and long_partial >= knobs.max_long_partial_prefills:
                self._unmatch(seq)
                skipped.append(seq)  # let shorter prompts behind it go first
                continue
            wanted = min(seq.num_uncomputed, budget)
            n = self._fit(seq, min(wanted, chunk))
            if n == 0:
                self._unmatch(seq)
                self.waiting.appendleft(seq)
                stop = HoldCause.KV_BLOCKS  # out of KV blocks: admit nothing more this iteration
                break
            out.chunk_deferred_tokens += wanted - min(wanted, chunk)
            self.block_manager.allocate(seq, n)
            self._count_admission(seq, out)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, is_prefill=True))
            budget -= n
            if seq.num_uncomputed - n > 0:
                partial += 1
                long_partial += int(is_long)
        if stop is not None:
            out.hold(stop, len(self.waiting))
        out.hold(HoldCause.LONG_PARTIAL_PREFILLS, len(skipped))
        self.waiting.extendleft(reversed(skipped))

    def _match(self, seq: Sequence) -> None:
        """Start a waiting sequence from its longest cached prefix (its blocks now held)."""
        self.block_manager.match_prefix(seq)

    def _unmatch(self, seq: Sequence) -> None:
        """Undo `_match` for a sequence that stays waiting (its blocks go back to the cache)."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0

    @staticmethod
    def _count_admission(seq: Sequence, out: SchedulerOutput) -> None:
        out.prefix_cache_queries += seq.num_tokens
        out.prefix_cache_hits += seq.num_computed_tokens
        if seq.num_cached_tokens is None:  # the request's first admission
            seq.num_cached_tokens = seq.num_computed_tokens

    def _fit(self, seq: Sequence, wanted: int) -> int:
        """How many of `wanted` tokens fit in the blocks `seq` has plus the free ones."""
        bm = self.block_manager
        capacity = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size - seq.num_computed_tokens
        return max(0, min(wanted, capacity))

    def _reserve(self, seq: Sequence, wanted: int, out: SchedulerOutput) -> tuple[int, int]:
        """Allocate blocks for up to `wanted` tokens of a running sequence, preempting the newest
        running sequences while nothing fits. Returns (tokens granted, 0 if `seq` itself was
        preempted; budget released by victims already scheduled this step). Each round removes
        one running sequence, so this always ends."""
        granted, released = self._fit(seq, wanted), 0
        while granted == 0:
            victim = max(self.running, key=lambda s: s.arrival_order)
            released += self._preempt(victim, out)
            if victim is seq:
                return 0, released
            granted = self._fit(seq, wanted)
        self.block_manager.allocate(seq, granted)
        return granted, released

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Send `seq` back to the head of the waiting queue (recompute); return the tokens it had
        been scheduled for this step, which go back to the budget."""
        released = 0
        for i, item in enumerate(out.scheduled):
            if item.seq is seq:
                released = item.num_tokens
                del out.scheduled[i]
                break
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        return released


def _needs_prefill(seq: Sequence) -> bool:
    """Prompt (or recomputed context) not fully computed yet: more than the one new token."""
    return seq.num_uncomputed > 1 or seq.num_output_tokens == 0
