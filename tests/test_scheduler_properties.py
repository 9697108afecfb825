"""Scheduler and block-manager invariants on hand-built sequences, no model: thousands of random
arrivals, lengths, aborts, knob changes and cache sizes in seconds.

The driver below plays the engine's part of an iteration exactly as `LLMEngine._postprocess`
does: every scheduled sequence's computed tokens advance by its grant, and a sequence whose
computed tokens caught up with its total samples one (fake) token; it finishes at `max_tokens`.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.engine import KnobError, Knobs, SamplingParams
from appliance.engine.block_manager import BlockManager
from appliance.engine.scheduler import Scheduler, SchedulerOutput
from appliance.engine.sequence import Sequence, Status

knob_sets = st.fixed_dictionaries(
    {},
    optional={
        "max_num_seqs": st.integers(1, 8),
        "max_num_batched_tokens": st.integers(8, 64),
        "long_prefill_token_threshold": st.integers(1, 64),
        "max_num_partial_prefills": st.integers(1, 4),
        "max_long_partial_prefills": st.integers(1, 4),
        "scheduling_policy": st.sampled_from(["continuous", "static"]),
    },
)


def make_seq(order: int, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(request_id=f"r{order}", prompt_token_ids=[1 + i % 50 for i in range(prompt_len)],
                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), detokenizer=None,
                    arrival_order=order)


def finish(scheduler: Scheduler, seq: Sequence) -> None:
    scheduler.remove(seq)
    seq.status = Status.FINISHED


def run_step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[Sequence]]:
    """One iteration without a model; returns the schedule and the sequences that finished."""
    out = scheduler.schedule()
    done = []
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_tokens
    for item in out.scheduled:
        seq = item.seq
        if seq.num_computed_tokens == seq.num_tokens:  # caught up: one token is sampled
            seq.output_token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                finish(scheduler, seq)
                done.append(seq)
    return out, done


def check_iteration(scheduler: Scheduler, out: SchedulerOutput, running_before: int) -> None:
    knobs, bm = scheduler.knobs, scheduler.block_manager
    assert out.num_tokens <= knobs.max_num_batched_tokens
    # Lowering max_num_seqs never evicts a running sequence; it only stops admissions.
    assert len(scheduler.running) <= max(knobs.max_num_seqs, running_before)
    seen = set()
    for item in out.scheduled:
        seq = item.seq
        assert seq.request_id not in seen, "a sequence scheduled twice in one iteration"
        seen.add(seq.request_id)
        assert seq.status is not Status.WAITING and item.num_tokens > 0  # FINISHED if it just ended
        if item.is_prefill:
            assert item.num_tokens <= knobs.long_prefill_token_threshold
        else:
            assert item.num_tokens == 1
        # after the driver advanced it: computed never passes total, blocks cover what is computed
        assert seq.num_computed_tokens <= seq.num_tokens
        if seq.status is Status.RUNNING:  # a finished one gave its blocks back
            assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
    if knobs.scheduling_policy == "continuous":  # each request left waiting counted under one cause
        assert sum(out.held.values()) == len(scheduler.waiting)
    for seq in out.preempted:
        assert seq.status is Status.WAITING and not seq.block_table and seq.num_computed_tokens == 0
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert sum(len(s.block_table) for s in scheduler.running) == bm.num_used_blocks
    bm.check_invariants()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    knob_plan=st.lists(knob_sets, max_size=5),
    num_blocks=st.integers(8, 64),
    block_size=st.sampled_from([1, 2, 4, 16]),
)
def test_invariants_hold_without_a_model(seed, knob_plan, num_blocks, block_size):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size)
    scheduler = Scheduler(bm, Knobs(max_num_seqs=4, max_num_batched_tokens=32, long_prefill_token_threshold=8,
                                    max_num_partial_prefills=2, max_long_partial_prefills=1))
    capacity = num_blocks * block_size
    submitted: list[Sequence] = []
    finished: list[str] = []
    plan = list(knob_plan)
    for _ in range(2000):
        if len(submitted) < 24 and rng.random() < 0.4:
            prompt = rng.randint(1, 40)
            # the engine admits only what fits in the whole cache (max_model_len <= capacity)
            max_tokens = rng.randint(1, 12)
            if prompt + max_tokens <= capacity:
                seq = make_seq(len(submitted), prompt, max_tokens)
                scheduler.add(seq)
                submitted.append(seq)
        live = [s for s in submitted if s.status is not Status.FINISHED]
        if live and rng.random() < 0.03:  # an abort, whatever state the sequence is in
            victim = rng.choice(live)
            finish(scheduler, victim)
            finished.append(victim.request_id)
        if plan and rng.random() < 0.05:
            try:
                scheduler.knobs = scheduler.knobs.with_changes(plan.pop())
            except KnobError:
                pass  # rejected whole: the scheduler keeps the knobs it had
        running_before = len(scheduler.running)
        out, done = run_step(scheduler)
        check_iteration(scheduler, out, running_before)
        finished.extend(s.request_id for s in done)
        if len(submitted) >= 24 and not scheduler.has_unfinished():
            break
    steps = 0
    while scheduler.has_unfinished():  # drain: everything admitted must end, within a bound
        running_before = len(scheduler.running)
        out, done = run_step(scheduler)
        check_iteration(scheduler, out, running_before)
        finished.extend(s.request_id for s in done)
        steps += 1
        assert steps < 20_000, "the scheduler stopped making progress"
    assert sorted(finished) == sorted(s.request_id for s in submitted)  # each ends exactly once
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == num_blocks


def test_a_long_prompt_is_chunked_and_decodes_once_caught_up():
    bm = BlockManager(64, 4)
    scheduler = Scheduler(bm, Knobs(max_num_seqs=4, max_num_batched_tokens=16, long_prefill_token_threshold=8,
                                    max_num_partial_prefills=1, max_long_partial_prefills=1))
    seq = make_seq(0, 20, 2)
    scheduler.add(seq)
    grants = []
    while scheduler.has_unfinished():
        out, _ = run_step(scheduler)
        grants.append([(item.num_tokens, item.is_prefill) for item in out.scheduled])
    # 20 prompt tokens in chunks of 8: 8, 8, 4 (the last chunk samples the first token), then one decode
    assert grants == [[(8, True)], [(8, True)], [(4, True)], [(1, False)]]
    assert bm.num_used_blocks == 0
