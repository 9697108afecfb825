"""The scheduler on hand-made sequences and a real BlockManager (no model)."""

from __future__ import annotations

from appliance.engine.block_manager import BlockManager
from appliance.engine.knobs import Knobs
from appliance.engine.sampling import SamplingParams
from appliance.engine.scheduler import Scheduler
from appliance.engine.sequence import Sequence, Status


def _running(scheduler: Scheduler, name: str, prompt_len: int, arrival_order: int, computed: int,
             output_tokens: int) -> Sequence:
    """A running sequence holding blocks for its whole prompt, `computed` of its tokens computed."""
    seq = Sequence(request_id=name, prompt_token_ids=list(range(1, prompt_len + 1)), params=SamplingParams(),
                   detokenizer=None, arrival_order=arrival_order)
    assert scheduler.block_manager.allocate(seq, prompt_len)
    seq.num_computed_tokens = computed
    seq.output_token_ids.extend([7] * output_tokens)
    seq.status = Status.RUNNING
    scheduler.running.append(seq)
    return seq


def test_preempting_a_sequence_scheduled_this_step_gives_its_budget_back():
    # Every block is taken. `late` (the newest arrival, first in admission order because it came
    # back after an earlier preemption) is scheduled first; `grows` then needs a fresh block for
    # its next token, so `late` is preempted. Its token goes back to the budget of 4: after
    # `grows` takes 1, the prefill of `prompt` (blocks already held) gets 3 (2 if it stayed spent).
    blocks = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(blocks, Knobs(max_num_seqs=4, max_num_batched_tokens=4, long_prefill_token_threshold=4))
    late = _running(scheduler, "late", prompt_len=3, arrival_order=5, computed=3, output_tokens=1)  # fits its block
    grows = _running(scheduler, "grows", prompt_len=4, arrival_order=1, computed=4, output_tokens=1)  # needs a block
    prompt = _running(scheduler, "prompt", prompt_len=8, arrival_order=2, computed=0, output_tokens=0)
    assert blocks.num_free_blocks == 0

    out = scheduler.schedule()

    assert out.preempted == [late] and late.status is Status.WAITING and late.block_table == []
    assert scheduler.waiting[0] is late and late.num_computed_tokens == 0
    assert [(item.seq, item.num_tokens, item.is_prefill) for item in out.scheduled] == [
        (grows, 1, False), (prompt, 3, True)]
    assert out.num_tokens == scheduler.knobs.max_num_batched_tokens  # the whole budget, never more
    assert len(grows.block_table) == 2 and blocks.num_free_blocks == 0
    blocks.check_invariants()
