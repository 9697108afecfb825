"""Greedy output of the engine equals transformers' own greedy `generate` (invariant 6)."""

from __future__ import annotations

import pytest
import torch

from appliance.engine import SamplingParams
from conftest import TEST_DEVICE

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4, 5,",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a wise old owl who knew every secret of the "
    "forest. One evening, a young fox came to ask the owl a question about the stars and the moon, and",
    "Translate to French: I would like a cup of coffee, please.",
    "Les mathématiques sont",
    "Q: What is the boiling point of water at sea level?\nA:",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "The three primary colors are",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def reference(loaded_model):
    """transformers' greedy generate, one prompt at a time (no padding), fp32."""
    tok, model = loaded_model.tokenizer, loaded_model.model
    refs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok.encode(prompt, add_special_tokens=False)
            out = model.generate(
                torch.tensor([ids], device=model.device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device),
                max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
            )
            refs.append(out[0, len(ids):].tolist())
    return refs


@pytest.fixture(params=["c-kernels", "torch"] if TEST_DEVICE == "cpu" else ["torch"])
def cpu_kernels(request) -> bool:
    """Both CPU paths: the C kernels (attention over the paged cache, fused elementwise ops)
    and torch alone (SDPA over gathered blocks). On CUDA only the torch path exists."""
    return request.param == "c-kernels"


def _engine_tokens(engine):
    # min_tokens bans EOS exactly as transformers' min_new_tokens does, so lengths match.
    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0)
    outs = engine.generate(PROMPTS, params)
    assert engine.block_manager.num_used_blocks == 0
    return [o.token_ids for o in outs]


def test_parity_all_at_once(make_engine, reference, cpu_kernels):
    engine = make_engine(max_num_seqs=16, max_num_batched_tokens=1024, long_prefill_token_threshold=1024,
                         cpu_kernels=cpu_kernels)
    assert (engine.runner.attention_kernel is not None) == cpu_kernels  # gcc is on every machine we test on
    assert _engine_tokens(engine) == reference


def test_parity_through_transformers_classes(make_engine, reference, cpu_kernels):
    # The fallback for models the lean forward does not cover: transformers' own layers calling
    # the paged attention through its attention interface (query/key/value arrive transposed).
    engine = make_engine(max_num_seqs=16, max_num_batched_tokens=1024, long_prefill_token_threshold=1024,
                         fast_forward=False, cpu_kernels=cpu_kernels)
    assert engine.runner.fast is None
    assert _engine_tokens(engine) == reference


def test_parity_multi_chunk_prefill(make_engine, reference, record_iterations, cpu_kernels):
    engine = make_engine(max_num_seqs=16, max_num_batched_tokens=64, long_prefill_token_threshold=16,
                         max_num_partial_prefills=3, max_long_partial_prefills=2, cpu_kernels=cpu_kernels)
    stats = record_iterations(engine)
    assert _engine_tokens(engine) == reference
    lengths = [len(engine.encode_prompt(p)) for p in PROMPTS]
    assert max(s.scheduled_tokens for s in stats) <= 64
    assert sum(s.prefill_tokens for s in stats) == sum(lengths)
    # the longest prompt needs several 16-token chunks, one per iteration
    assert sum(1 for s in stats if s.prefill_tokens) >= -(-max(lengths) // 16) > 1


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the C kernels run on the CPU only")
@pytest.mark.parametrize("kernel_prefill_context", [1 << 20, 0, 24])
def test_parity_with_either_prefill_attention_beside_the_kernel(make_engine, reference, record_iterations,
                                                                kernel_prefill_context):
    # How far the kernel attends prefill with the kernels on is timed on the machine at hand; here
    # it is forced: every chunk, none, and those ending by position 24 (both ways in one step).
    # By the kernel, steps hand it decode, padding and chunk rows in one call.
    engine = make_engine(max_num_seqs=16, max_num_batched_tokens=40, long_prefill_token_threshold=16,
                         max_num_partial_prefills=3, max_long_partial_prefills=2)
    runner = engine.runner
    assert runner.attention_kernel is not None
    runner.kernel_prefill_context = kernel_prefill_context
    ways = []  # per step: whether each of its prefill chunks went to the kernel
    execute = runner.execute

    def recording(sched):
        ways.append({s.seq.num_computed_tokens + s.num_tokens <= kernel_prefill_context
                     for s in sched.scheduled if s.is_prefill})
        return execute(sched)

    runner.execute = recording
    stats = record_iterations(engine)
    assert _engine_tokens(engine) == reference
    assert any(s.prefill_tokens and s.decode_tokens for s in stats)  # chunks beside decode rows
    assert any(way == {True, False} for way in ways) == (kernel_prefill_context == 24)


def test_parity_under_preemption(make_engine, reference, record_iterations, cpu_kernels):
    # 10 sequences need ~95 blocks of 4 tokens at their longest; 48 forces preemption.
    engine = make_engine(num_blocks=48, block_size=4, max_num_seqs=16, max_num_batched_tokens=256,
                         long_prefill_token_threshold=256, max_num_partial_prefills=4, cpu_kernels=cpu_kernels)
    stats = record_iterations(engine)
    assert _engine_tokens(engine) == reference
    assert sum(s.preemptions for s in stats) > 0


def test_static_policy_same_answers(make_engine, reference, cpu_kernels):
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=256, scheduling_policy="static", cpu_kernels=cpu_kernels)
    assert _engine_tokens(engine) == reference


def test_parity_with_decode_rows_in_length_groups(make_engine, reference):
    # Blocks of 4 tokens: the prompts' contexts span 2 to 14 blocks, so decode rows are cut into
    # several groups of similar length, each attended in its own call.
    engine = make_engine(block_size=4, max_num_seqs=16, max_num_batched_tokens=1024, long_prefill_token_threshold=1024,
                         cpu_kernels=False)
    seen = []
    build = engine.runner._decode_groups

    def spy(tables, ctx_lens):
        groups = build(tables, ctx_lens)
        seen.append(len(groups))
        return groups

    engine.runner._decode_groups = spy
    assert _engine_tokens(engine) == reference
    assert max(seen) > 1
