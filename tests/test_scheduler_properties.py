"""Scheduler and block-manager invariants on hand-built sequences, no model: thousands of random
arrivals, lengths, aborts, knob changes and cache sizes in seconds.

The driver below plays the engine's part of an iteration exactly as `LLMEngine._postprocess`
does: every scheduled sequence's computed tokens advance by its grant, and a sequence whose
computed tokens caught up with its total samples one (fake) token; it finishes at `max_tokens`.

It also plays the model runner's part for the KV cache: computing position p of a sequence
writes, into the slot its block table names, a fingerprint of the tokens 0..p (what the real K/V
at that slot depends on). Every running sequence's computed slots must still hold its own
fingerprints at every iteration: a block shared by prefix caching must hold the same prefix, and
a block in a running table must never be evicted, reused or overwritten.
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
        "enable_prefix_caching": st.booleans(),
    },
)


class FakeKV:
    """The K/V contents the driver writes: slot -> fingerprint of the prefix it was computed for."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}
        self._chains: dict[str, list[int]] = {}

    def fingerprints(self, seq: Sequence) -> list[int]:
        """fingerprints[p] identifies the tokens 0..p of `seq` (extended as it grows)."""
        chain = self._chains.setdefault(seq.request_id, [])
        for p in range(len(chain), seq.num_tokens):
            chain.append(hash((chain[-1] if chain else 0, seq.tokens(p, p + 1)[0])))
        return chain

    def write(self, seq: Sequence, start: int, end: int) -> None:
        chain, bs = self.fingerprints(seq), self.block_size
        for p in range(start, end):
            self.slots[(seq.block_table[p // bs], p % bs)] = chain[p]

    def check(self, seq: Sequence) -> None:
        """First and last computed slot of each of `seq`'s blocks hold its own prefix (a block
        handed to another sequence is rewritten from its first slot)."""
        chain, bs = self.fingerprints(seq), self.block_size
        for i in range(-(-seq.num_computed_tokens // bs)):
            block = seq.block_table[i]
            for p in {i * bs, min((i + 1) * bs, seq.num_computed_tokens) - 1}:
                assert self.slots.get((block, p % bs)) == chain[p], (
                    f"{seq.request_id}: block {block} slot {p % bs} does not hold its prefix")


def make_seq(order: int, prompt_len: int, max_tokens: int, prompt: list[int] | None = None) -> Sequence:
    tokens = prompt if prompt is not None else [1 + i % 50 for i in range(prompt_len)]
    return Sequence(request_id=f"r{order}", prompt_token_ids=tokens,
                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), detokenizer=None,
                    arrival_order=order)


def finish(scheduler: Scheduler, seq: Sequence) -> None:
    scheduler.remove(seq)
    seq.status = Status.FINISHED


def run_step(scheduler: Scheduler, kv: FakeKV | None = None, rng: random.Random | None = None
             ) -> tuple[SchedulerOutput, list[Sequence]]:
    """One iteration without a model; returns the schedule and the sequences that finished.
    With `kv`, writes the computed slots; with `rng`, samples random tokens (else always 7)."""
    out = scheduler.schedule()
    done = []
    for item in out.scheduled:
        if kv is not None:
            kv.write(item.seq, item.seq.num_computed_tokens, item.seq.num_computed_tokens + item.num_tokens)
        item.seq.num_computed_tokens += item.num_tokens
    for item in out.scheduled:
        seq = item.seq
        if seq.num_computed_tokens == seq.num_tokens:  # caught up: one token is sampled
            seq.output_token_ids.append(rng.randint(1, 6) if rng else 7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                finish(scheduler, seq)
                done.append(seq)
    return out, done


def check_iteration(scheduler: Scheduler, out: SchedulerOutput, running_before: int, kv: FakeKV | None = None
                    ) -> None:
    knobs, bm = scheduler.knobs, scheduler.block_manager
    assert 0 <= out.prefix_cache_hits <= out.prefix_cache_queries
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
    for seq in scheduler.waiting:
        assert not seq.block_table and seq.num_computed_tokens == 0
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    assert 0 <= bm.num_cached_free_blocks <= bm.num_free_blocks
    # Shared blocks: each block in use is held exactly by the running tables that list it.
    holders: dict[int, int] = {}
    for seq in scheduler.running:
        assert len(set(seq.block_table)) == len(seq.block_table), "a block twice in one table"
        for block in seq.block_table:
            holders[block] = holders.get(block, 0) + 1
        if kv is not None:
            kv.check(seq)
    assert len(holders) == bm.num_used_blocks
    assert all(bm.ref_count(block) == n for block, n in holders.items())
    if not knobs.enable_prefix_caching:  # blocks still shared stay shared until their holders end
        assert bm.num_cached_free_blocks == 0 and not any(bm.is_cached(b) for b in range(bm.num_blocks))
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
    kv = FakeKV(block_size)
    # a few shared prefixes (system prompts, earlier turns); prompts are a prefix of one plus a tail
    prefixes = [[rng.randint(1, 6) for _ in range(40)] for _ in range(3)]
    submitted: list[Sequence] = []
    finished: list[str] = []
    plan = list(knob_plan)
    for _ in range(2000):
        if len(submitted) < 24 and rng.random() < 0.4:
            prompt = rng.randint(1, 40)
            # the engine admits only what fits in the whole cache (max_model_len <= capacity)
            max_tokens = rng.randint(1, 12)
            if prompt + max_tokens <= capacity:
                shared = rng.randint(0, prompt) if rng.random() < 0.8 else 0
                tokens = rng.choice(prefixes)[:shared] + [rng.randint(1, 6) for _ in range(prompt - shared)]
                seq = make_seq(len(submitted), prompt, max_tokens, tokens)
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
        out, done = run_step(scheduler, kv, rng)
        check_iteration(scheduler, out, running_before, kv)
        finished.extend(s.request_id for s in done)
        if len(submitted) >= 24 and not scheduler.has_unfinished():
            break
    steps = 0
    while scheduler.has_unfinished():  # drain: everything admitted must end, within a bound
        running_before = len(scheduler.running)
        out, done = run_step(scheduler, kv, rng)
        check_iteration(scheduler, out, running_before, kv)
        finished.extend(s.request_id for s in done)
        steps += 1
        assert steps < 20_000, "the scheduler stopped making progress"
    assert sorted(finished) == sorted(s.request_id for s in submitted)  # each ends exactly once
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == num_blocks  # nothing leaks when idle
    assert all(bm.ref_count(b) == 0 for b in range(num_blocks))
    bm.check_invariants()


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


# -- prefix caching, by hand --------------------------------------------------------------------
def caching_scheduler(num_blocks: int, block_size: int, **knobs) -> Scheduler:
    settings = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "long_prefill_token_threshold": 8,
                "max_num_partial_prefills": 1, "max_long_partial_prefills": 1, **knobs}
    return Scheduler(BlockManager(num_blocks, block_size), Knobs(**settings))


def run_alone(scheduler: Scheduler, seq: Sequence) -> list[SchedulerOutput]:
    """Submit `seq` and step until it ends; return every schedule."""
    scheduler.add(seq)
    outs = []
    while scheduler.has_unfinished():
        outs.append(run_step(scheduler)[0])
    return outs


def test_an_identical_prompt_reuses_every_full_block_but_computes_its_last_token():
    scheduler = caching_scheduler(32, 4)
    prompt = list(range(1, 21))  # 20 tokens: 5 full blocks
    run_alone(scheduler, make_seq(0, 0, 2, prompt))
    assert scheduler.block_manager.num_cached_free_blocks == 5  # 20 prompt + 1 output computed
    second = make_seq(1, 0, 2, list(prompt))
    outs = run_alone(scheduler, second)
    # an exact multiple of the block size: the last block is recomputed for its last token
    assert second.num_cached_tokens == 16
    assert (outs[0].prefix_cache_queries, outs[0].prefix_cache_hits) == (20, 16)
    assert [(i.num_tokens, i.is_prefill) for i in outs[0].scheduled] == [(4, True)]
    third = make_seq(2, 0, 1, prompt + [99, 98])  # a longer prompt with the same start
    run_alone(scheduler, third)
    assert third.num_cached_tokens == 20
    scheduler.block_manager.check_invariants()


def test_each_full_block_is_hashed_once_not_every_step(monkeypatch):
    import appliance.engine.block_manager as block_manager

    calls: list[tuple[bytes, tuple[int, ...]]] = []
    real = block_manager.block_hash

    def counting(parent: bytes, token_ids: list[int]) -> bytes:
        calls.append((parent, tuple(token_ids)))
        return real(parent, token_ids)

    monkeypatch.setattr(block_manager, "block_hash", counting)
    scheduler = caching_scheduler(32, 4)
    seq = make_seq(0, 0, 9, list(range(1, 21)))  # 20 prompt tokens in chunks of 8, then 9 decodes
    outs = run_alone(scheduler, seq)
    assert len(outs) > len(calls)  # more steps than hashes
    assert len(set(calls)) == len(calls) == len(seq.block_hashes) == 7  # 28 computed tokens: 7 full blocks


def test_budget_and_long_prompt_limits_count_only_uncached_tokens():
    scheduler = caching_scheduler(64, 4, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    prompt = [(i * 7) % 11 + 1 for i in range(41)]
    run_alone(scheduler, make_seq(0, 0, 1, prompt))
    long_again = make_seq(1, 0, 1, list(prompt))
    short = make_seq(2, 0, 1, [42, 43, 44])
    scheduler.add(long_again)
    scheduler.add(short)
    out, _ = run_step(scheduler)
    # 40 of 41 tokens cached: one uncached token, not a long prompt; the short one joins it
    assert [(i.seq.request_id, i.num_tokens) for i in out.scheduled] == [("r1", 1), ("r2", 3)]


def test_never_used_blocks_go_first_then_cached_ones_least_recently_used():
    scheduler = caching_scheduler(4, 2)
    bm = scheduler.block_manager
    run_alone(scheduler, make_seq(0, 0, 1, [1, 2, 3, 4, 5]))  # caches [1,2] and [3,4]; [5] private
    assert bm.num_cached_free_blocks == 2
    run_alone(scheduler, make_seq(1, 0, 1, [9, 9, 8]))  # takes the two plain free blocks, caches [9,9]
    assert bm.num_cached_free_blocks == 3
    # 2 blocks: the one plain free block, then one eviction: the least recently used cached block
    # is [3,4] (a sequence's blocks are freed tail first, so its first block stays longest)
    run_alone(scheduler, make_seq(2, 0, 1, [7, 7, 7]))
    hits = {}
    for order, prompt in ((3, [9, 9, 1]), (4, [1, 2, 3, 4, 5])):
        seq = make_seq(order, 0, 1, prompt)
        run_alone(scheduler, seq)
        hits[tuple(prompt)] = seq.num_cached_tokens
    assert hits == {(9, 9, 1): 2, (1, 2, 3, 4, 5): 2}  # [9,9] and [1,2] survived, [3,4] did not
    bm.check_invariants()
    assert bm.num_used_blocks == 0


def test_a_preempted_sequence_rematches_its_own_blocks():
    # Two sequences grow until the cache runs out; the newer one is preempted and, once it can
    # come back, starts from its own cached blocks instead of recomputing them.
    scheduler = caching_scheduler(6, 4, max_num_seqs=2)
    older = make_seq(0, 0, 6, [1] * 9)
    newer = make_seq(1, 0, 4, [2] * 9)
    scheduler.add(older)
    scheduler.add(newer)
    comebacks = []
    while scheduler.has_unfinished():
        out, _ = run_step(scheduler)
        if any(item.seq is newer for item in out.scheduled) and newer.preemptions and not comebacks:
            comebacks.append(out.prefix_cache_hits)
    assert newer.preemptions >= 1 and comebacks and comebacks[0] >= 8
    assert scheduler.block_manager.num_used_blocks == 0


def test_turning_caching_off_stops_matching_and_frees_cached_blocks():
    scheduler = caching_scheduler(16, 4)
    bm = scheduler.block_manager
    prompt = list(range(1, 14))
    run_alone(scheduler, make_seq(0, 0, 1, prompt))
    assert bm.num_cached_free_blocks == 3
    scheduler.knobs = scheduler.knobs.with_changes({"enable_prefix_caching": False})
    off = make_seq(1, 0, 1, list(prompt))
    outs = run_alone(scheduler, off)
    assert off.num_cached_tokens == 0 and outs[0].prefix_cache_hits == 0
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 16
    scheduler.knobs = scheduler.knobs.with_changes({"enable_prefix_caching": True})
    run_alone(scheduler, make_seq(2, 0, 1, list(prompt)))
    on = make_seq(3, 0, 1, list(prompt))
    run_alone(scheduler, on)
    assert on.num_cached_tokens == 12


def test_static_policy_admits_from_the_cache():
    scheduler = caching_scheduler(8, 4, scheduling_policy="static")
    prompt = list(range(1, 18))
    run_alone(scheduler, make_seq(0, 0, 1, prompt))
    # 17 tokens: 4 full blocks are matched, only the last token is computed
    second = make_seq(1, 0, 1, list(prompt))
    outs = run_alone(scheduler, second)
    assert second.num_cached_tokens == 16 and outs[0].scheduled[0].num_tokens == 1


def test_enable_prefix_caching_must_be_a_boolean():
    try:
        Knobs().with_changes({"enable_prefix_caching": 1})
    except KnobError as exc:
        assert set(exc.errors) == {"enable_prefix_caching"}
    else:
        raise AssertionError("a non-boolean enable_prefix_caching was accepted")
