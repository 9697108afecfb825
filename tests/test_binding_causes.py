"""Binding-cause counters: each limit alone, on hand-built scheduler situations (no model), then
the engine's IterationStats and /metrics carrying them."""

from __future__ import annotations

import itertools

import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.engine import Knobs, SamplingParams
from appliance.engine.block_manager import BlockManager
from appliance.engine.scheduler import Scheduler, SchedulerOutput
from appliance.engine.sequence import Sequence
from appliance.records import HoldCause, IterationStats, ITERATION_METRICS

_tickets = itertools.count()
ROOMY = dict(max_num_seqs=64, max_num_batched_tokens=256, long_prefill_token_threshold=256,
             max_num_partial_prefills=4, max_long_partial_prefills=4)


def scheduler(num_blocks: int = 256, block_size: int = 4, **knobs) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), Knobs(**{**ROOMY, **knobs}))


def queue(s: Scheduler, *prompt_lens: int, max_tokens: int = 4) -> list[Sequence]:
    seqs = []
    for n in prompt_lens:
        order = next(_tickets)
        seq = Sequence(request_id=f"r{order}", prompt_token_ids=[5] * n,
                       params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), detokenizer=None,
                       arrival_order=order)
        s.add(seq)
        seqs.append(seq)
    return seqs


def advance(out: SchedulerOutput) -> None:
    """The engine's part of an iteration: computed tokens advance; a caught-up sequence samples."""
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_tokens
        if item.seq.num_computed_tokens == item.seq.num_tokens:
            item.seq.output_token_ids.append(7)


def held(out: SchedulerOutput) -> dict[str, int]:
    return {str(cause): count for cause, count in out.held.items()}


def test_nothing_held_when_everything_fits():
    s = scheduler()
    queue(s, 4, 4, 4)
    out = s.schedule()
    assert len(out.scheduled) == 3 and out.held == {} and out.chunk_deferred_tokens == 0


def test_max_num_seqs_alone():
    s = scheduler(max_num_seqs=2)
    queue(s, 4, 4, 4, 4, 4)
    out = s.schedule()
    assert len(out.scheduled) == 2
    assert held(out) == {"max_num_seqs": 3} and out.chunk_deferred_tokens == 0


def test_token_budget_alone():
    s = scheduler(max_num_seqs=8, max_num_batched_tokens=8, long_prefill_token_threshold=8)
    queue(s, 8, 8, 8)
    out = s.schedule()
    assert [i.num_tokens for i in out.scheduled] == [8]
    assert held(out) == {"max_num_batched_tokens": 2} and out.chunk_deferred_tokens == 0


def test_kv_blocks_alone():
    s = scheduler(num_blocks=2, block_size=4)
    queue(s, 8, 8)
    out = s.schedule()
    assert [i.num_tokens for i in out.scheduled] == [8]
    assert held(out) == {"kv_blocks": 1} and not out.preempted


def test_partial_prefills_alone():
    # One unfinished (chunked) prefill allowed; the long-prompt limit is not what stops the rest.
    s = scheduler(long_prefill_token_threshold=4, max_num_partial_prefills=1, max_long_partial_prefills=1)
    queue(s, 3, 10, 3, 3)
    out = s.schedule()
    assert [i.num_tokens for i in out.scheduled] == [3, 4]
    assert held(out) == {"max_num_partial_prefills": 2}


def test_long_partial_prefills_alone():
    # Two unfinished prefills allowed, one of them long: the second long prompt is skipped and
    # the short one behind it goes first.
    s = scheduler(long_prefill_token_threshold=4, max_num_partial_prefills=2, max_long_partial_prefills=1)
    first_long, second_long, short = queue(s, 10, 10, 3)
    out = s.schedule()
    assert [i.seq for i in out.scheduled] == [first_long, short]
    assert held(out) == {"max_long_partial_prefills": 1}
    assert list(s.waiting) == [second_long]


def test_chunk_deferral_alone():
    s = scheduler(long_prefill_token_threshold=4, max_num_batched_tokens=64)
    (seq,) = queue(s, 10)
    out = s.schedule()
    assert out.held == {} and out.chunk_deferred_tokens == 6  # 10 fitted the budget, 4 ran
    advance(out)
    out = s.schedule()  # an unfinished prefill: 6 left, chunk 4, budget 64
    assert out.chunk_deferred_tokens == 2 and out.held == {}
    # bounded by the budget, not the prompt: the budget alone would have allowed only 5
    s = scheduler(max_num_seqs=4, long_prefill_token_threshold=4, max_num_batched_tokens=5)
    queue(s, 10)
    assert s.schedule().chunk_deferred_tokens == 1


def test_preemption_for_kv_holds_the_queue_and_counts_the_victim():
    s = scheduler(num_blocks=2, block_size=4)
    a, b = queue(s, 4, 4, max_tokens=8)
    advance(s.schedule())  # both prompts fill their block; each sampled a token
    (c,) = queue(s, 2)
    out = s.schedule()  # each decode needs a second block: the newest (b) is preempted
    assert out.preempted == [b]
    assert held(out) == {"kv_blocks": 2}  # b (back at the head) and c
    assert list(s.waiting) == [b, c]


def test_static_policy_counts_nothing():
    s = scheduler(max_num_seqs=1, scheduling_policy="static")
    queue(s, 4, 4)
    out = s.schedule()
    assert out.held == {} and len(s.waiting) == 1


def test_every_cause_has_a_recorded_column():
    columns = {m.name: m for m in ITERATION_METRICS}
    for cause in HoldCause:
        assert columns[cause.column].rollup and columns[cause.column].type is int
    assert columns["chunk_deferred_tokens"].rollup


def _iteration(**values) -> IterationStats:
    base = {m.name: (0.0 if m.type is float else "continuous" if m.type is str else 0) for m in ITERATION_METRICS}
    return IterationStats(**{**base, **values})


def test_metrics_endpoint_counts_each_cause():
    from appliance.server.metrics import ServerMetrics

    snapshot = {"running": 0, "waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 1, "knob_version": 0,
                "knobs": {}, "telemetry_rows_dropped": 0}
    m = ServerMetrics(lambda: snapshot)
    m.on_iteration(_iteration(held_by_max_num_seqs=3, held_by_kv_blocks=1, chunk_deferred_tokens=6))
    m.on_iteration(_iteration(held_by_max_num_seqs=2, held_by_long_partial_prefills=1, preemptions=1))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}
    held_total = {cause: samples[("appliance:num_requests_held_total", (("cause", str(cause)),))]
                  for cause in HoldCause}
    assert held_total == {HoldCause.MAX_NUM_SEQS: 5, HoldCause.TOKEN_BUDGET: 0, HoldCause.KV_BLOCKS: 1,
                          HoldCause.PARTIAL_PREFILLS: 0, HoldCause.LONG_PARTIAL_PREFILLS: 1}
    assert samples[("appliance:prefill_tokens_deferred_by_chunk_total", ())] == 6
    assert samples[("appliance:num_preemptions_total", ())] == 1


@pytest.mark.parametrize("max_num_seqs", [2])
def test_engine_publishes_the_counters(make_engine, record_iterations, max_num_seqs):
    engine = make_engine(max_num_seqs=max_num_seqs, long_prefill_token_threshold=4, max_num_partial_prefills=2)
    iterations = record_iterations(engine)
    engine.generate([[5] * 10, [6] * 3, [7] * 3, [8] * 3], SamplingParams(max_tokens=2, ignore_eos=True))
    first = iterations[0]
    # 10-token prompt chunked to 4 (6 deferred), one short one admitted, two held by max_num_seqs
    assert (first.prefill_tokens, first.chunk_deferred_tokens, first.held_by_max_num_seqs) == (7, 6, 2)
    assert first.held_by_kv_blocks == first.held_by_token_budget == 0
    for it in iterations:  # every request left waiting is counted under one cause
        assert sum(getattr(it, c.column) for c in HoldCause) == it.waiting
