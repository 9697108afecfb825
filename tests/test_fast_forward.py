"""The lean llama forward matches transformers' logits, and other models fall back."""

from __future__ import annotations

import pytest
import torch

from appliance.engine import EngineConfig, Knobs, LLMEngine, SamplingParams
from appliance.engine import fast_llama


def _last_logits(engine, prompt_ids):
    """Run a prompt through the engine's runner chunk by chunk; logits of its last token."""
    engine.add_request("p", prompt_ids, SamplingParams(max_tokens=1, temperature=0))
    logits = None
    while logits is None or logits.numel() == 0:
        sched = engine.scheduler.schedule()
        result = engine.runner.execute(sched)
        for item in sched.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
        logits = result.logits
    engine.abort("p")
    return logits[0]


def test_lean_forward_logits_match_transformers(loaded_model):
    assert fast_llama.supports(loaded_model.model)
    prompt = loaded_model.tokenizer.encode("The lean forward must agree with transformers, chunk by chunk, to the last digit.")
    with torch.inference_mode():
        reference = loaded_model.model(torch.tensor([prompt])).logits[0, -1].float()
    for fast, kernels in ((True, True), (True, False), (False, True), (False, False)):
        cfg = EngineConfig(dtype="float32", device="cpu", num_blocks=64, fast_forward=fast, cpu_kernels=kernels,
                           knobs=Knobs(max_num_batched_tokens=64, long_prefill_token_threshold=8))
        engine = LLMEngine(cfg, loaded=loaded_model)
        assert (engine.runner.fast is not None) == fast
        if fast:
            assert (engine.runner.fast.kernels is not None) == kernels
        got = _last_logits(engine, prompt)
        assert torch.allclose(got, reference, atol=1e-3, rtol=1e-4), (fast, kernels, (got - reference).abs().max())
        assert got.argmax() == reference.argmax()


def test_unsupported_models_use_transformers_classes(loaded_model, monkeypatch):
    monkeypatch.setattr(loaded_model.model.config, "attention_bias", True, raising=False)
    assert not fast_llama.supports(loaded_model.model)


def test_packed_linear_matches_f_linear_at_any_row_count():
    torch.manual_seed(0)
    weight = torch.randn(96, 40)
    linear = fast_llama.PackedLinear(weight)
    assert linear.packed is not None  # oneDNN is part of every CPU build of torch
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 40)
        assert torch.allclose(linear(x), torch.nn.functional.linear(x, weight), atol=1e-5, rtol=1e-5)
    strided = torch.randn(10, 40)[::2]
    assert torch.allclose(linear(strided), torch.nn.functional.linear(strided, weight), atol=1e-5, rtol=1e-5)
    residual = torch.randn(5, 96)
    assert torch.allclose(linear(strided, residual=residual), residual + torch.nn.functional.linear(strided, weight),
                          atol=1e-5, rtol=1e-5)


def test_packed_linear_runs_plain_f_linear_up_to_its_plain_rows():
    torch.manual_seed(0)
    weight = torch.randn(96, 40)
    linear = fast_llama.PackedLinear(weight, plain_rows=2)
    linear.packed = object()  # the packed weight can no longer be used: any call that tries fails
    for rows in (1, 2):
        x, residual = torch.randn(rows, 40), torch.randn(rows, 96)
        assert torch.equal(linear(x), torch.nn.functional.linear(x, weight))
        assert torch.equal(linear(x, residual=residual), residual + torch.nn.functional.linear(x, weight))
    with pytest.raises((TypeError, RuntimeError)):
        linear(torch.randn(3, 40))


@pytest.mark.parametrize("times, rows", [
    ([1.0, 2.0, 1.0, 2.0], 2),  # BLAS wins at one and at two rows
    ([1.0, 2.0, 1.9, 2.0], 1),  # at one row only
    ([0.9, 1.0, 0.1, 1.0], 0),  # not by PLAIN_MARGIN at one row: two rows are not tried
])
def test_plain_rows_count_up_while_blas_wins_by_the_margin(times, rows):
    linear = fast_llama.PackedLinear(torch.randn(64, 32))
    clock = iter(times)

    def timed(fns):  # runs the calls (they must work) and reports the scripted times
        for fn in fns:
            fn()
        return [next(clock) for _ in fns]

    assert fast_llama.faster_plain_rows(linear, timed) == rows
    assert fast_llama.faster_plain_rows(fast_llama.PackedLinear(torch.randn(8, 8, dtype=torch.float16)), timed) == 0


def test_the_forward_applies_its_timed_plain_rows_to_every_matmul(loaded_model):
    forward = fast_llama.FastLlamaForward(loaded_model.model)
    assert forward.plain_rows in (0, *fast_llama.PLAIN_ROWS_TRIED)
    assert {lin.plain_rows for lin in forward.linears()} == {forward.plain_rows}
    assert forward.own_rows == 0 and all(lin.own is None for lin in forward.linears())  # no kernels, no own GEMM
    assert len(forward.linears()) == 4 * len(forward.layers) + 1


HALF = (fast_llama.OWN_MARGIN - 1) / 2
WIN, CLOSE_WIN, LOSS = [1.0, 2.0], [1 + HALF, 1.0], [fast_llama.OWN_MARGIN + HALF, 1.0]  # (own, replaced) per timing


LOST_COUNT = [LOSS, LOSS]  # a count's timing and its second timing, both lost
ALL = len(fast_llama.OWN_ROWS_TRIED)


@pytest.mark.parametrize("timings, last_won", [  # last_won: 1-based index in OWN_ROWS_TRIED, 0 for none
    ([WIN, WIN, CLOSE_WIN, *LOST_COUNT, *LOST_COUNT], 3),  # slower by half the margin wins: the one call is worth that
    ([WIN, LOSS, WIN, *LOST_COUNT, *LOST_COUNT], 2),  # a loss timed again: the second timing's win counts
    ([[fast_llama.OWN_MARGIN, 1.0], *LOST_COUNT, *LOST_COUNT], 1),  # slower by exactly the margin: a win
    ([WIN] * ALL, ALL),  # won at every count
    ([WIN] * (ALL - 1) + LOST_COUNT, ALL - 1),  # lost at the last count only
    ([*LOST_COUNT, *LOST_COUNT], 0),  # lost at the first two counts: none
    ([WIN, *LOST_COUNT, WIN, WIN, *LOST_COUNT, *LOST_COUNT], 3),  # count 2 wins when timed after count 3: a slow spell
    ([WIN, *LOST_COUNT, WIN, *LOST_COUNT], 1),  # count 2 loses again after count 3 won: the count stops before it
    ([WIN, *LOST_COUNT, LOSS, WIN, WIN, *LOST_COUNT, *LOST_COUNT], 3),  # count 3 won at its second timing
])
def test_own_rows_is_the_last_count_won_past_a_slow_spell(kernel, timings, last_won):
    times = [t for pair in timings for t in pair]  # once the count stops the rest are not tried
    rows = fast_llama.OWN_ROWS_TRIED[last_won - 1] if last_won else 0
    linear = fast_llama.PackedLinear(torch.randn(64, 32), kernels=kernel)
    clock = iter(times)

    def timed(fns):  # runs the calls (they must work) and reports the scripted times
        for fn in fns:
            fn()
        return [next(clock) for _ in fns]

    assert fast_llama.faster_own_rows([linear, linear], timed) == rows
    assert next(clock, None) is None  # every scripted timing taken, none more


def test_own_rows_are_timed_once_a_process_for_the_same_weight_shapes(kernel, monkeypatch):
    monkeypatch.setattr(fast_llama, "_OWN_ROWS", {})
    timed_on = []
    monkeypatch.setattr(fast_llama, "faster_own_rows", lambda linears: timed_on.append(len(linears)) or 64)
    pair = [fast_llama.PackedLinear(torch.randn(64, 32), kernels=kernel) for _ in range(2)]
    again = [fast_llama.PackedLinear(torch.randn(64, 32), kernels=kernel) for _ in range(2)]
    assert fast_llama.own_rows_on_this_cpu(pair) == fast_llama.own_rows_on_this_cpu(again) == 64
    fast_llama.own_rows_on_this_cpu([fast_llama.PackedLinear(torch.randn(96, 32), kernels=kernel)])
    assert timed_on == [2, 1]  # the second pair of the same shapes was not timed again
    assert fast_llama.own_rows_on_this_cpu([fast_llama.PackedLinear(torch.randn(8, 8))]) == 0  # no kernels: no copy
    assert fast_llama.own_rows_on_this_cpu([]) == 0 and timed_on == [2, 1]


@pytest.mark.parametrize("own_rows", [0, 256])
def test_prefill_and_decode_logits_match_transformers_with_or_without_the_own_gemm(loaded_model, monkeypatch, own_rows):
    """Chunks of 64 rows and one-row steps through the C kernels' GEMM, or all through oneDNN."""
    monkeypatch.setattr(fast_llama, "_OWN_ROWS", {})
    monkeypatch.setattr(fast_llama, "faster_own_rows", lambda linears, **_: own_rows)
    prompt = loaded_model.tokenizer.encode("Packed twice, multiplied either way, the logits must not move at all.")
    with torch.inference_mode():
        reference = loaded_model.model(torch.tensor([prompt])).logits[0, -1].float()
    for threshold in (64, 1):  # prefill in chunks of up to 64 rows, then one token a step
        cfg = EngineConfig(dtype="float32", device="cpu", num_blocks=64, fast_forward=True, cpu_kernels=True,
                           knobs=Knobs(max_num_batched_tokens=64, long_prefill_token_threshold=threshold))
        engine = LLMEngine(cfg, loaded=loaded_model)
        assert {lin.own_rows for lin in engine.runner.fast.linears()} == {own_rows}
        got = _last_logits(engine, prompt)
        assert torch.allclose(got, reference, atol=1e-3, rtol=1e-4), (own_rows, threshold, (got - reference).abs().max())
        assert got.argmax() == reference.argmax()


@pytest.mark.parametrize("plain_rows", [0, 2])
def test_one_row_decode_logits_match_transformers_either_way(loaded_model, monkeypatch, plain_rows):
    """A decode step of one sequence (one row per matmul) through the packed call and through BLAS."""
    monkeypatch.setattr(fast_llama, "faster_plain_rows", lambda linear, **_: plain_rows)
    prompt = loaded_model.tokenizer.encode("One row at a time, the logits must not move.")
    with torch.inference_mode():
        reference = loaded_model.model(torch.tensor([prompt])).logits[0, -1].float()
    cfg = EngineConfig(dtype="float32", device="cpu", num_blocks=64, fast_forward=True, cpu_kernels=True,
                       knobs=Knobs(max_num_batched_tokens=64, long_prefill_token_threshold=1))
    engine = LLMEngine(cfg, loaded=loaded_model)
    assert engine.runner.fast.plain_rows == plain_rows
    got = _last_logits(engine, prompt)  # one token a step: every step runs one row
    assert torch.allclose(got, reference, atol=1e-3, rtol=1e-4), (got - reference).abs().max()
    assert got.argmax() == reference.argmax()


def _step_logits(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[torch.Tensor], int]:
    """Every step's logits over `prompts` (greedy, run to max_tokens), and how many steps ran their
    layers in one `decoder_layers` call."""
    logits, in_one_call = [], 0
    fast, execute, one_call = engine.runner.fast, engine.runner.execute, engine.runner.fast._layers_in_one_call

    def counted(*args):
        nonlocal in_one_call
        in_one_call += 1
        return one_call(*args)

    def kept(sched):
        result = execute(sched)
        logits.append(result.logits.clone())
        return result

    fast._layers_in_one_call, engine.runner.execute = counted, kept
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return logits, in_one_call


def _fused_and_looped(loaded_model, kernel, monkeypatch, dtype: str, policy: str, kernel_prefill: int):
    """Three prompts run twice, layers in one call where they can be and always looped:
    ((every step's logits, steps in one call), (the same, looped)). One layer's second norm gets an
    epsilon of its own (the model's are all equal), so that each norm must read its own layer's."""
    from appliance.engine import model_runner
    from appliance.model_loader import load_model

    loaded = loaded_model if dtype == "float32" else load_model(dtype="bfloat16", device="cpu")
    monkeypatch.setattr(fast_llama, "_OWN_ROWS", {})
    monkeypatch.setattr(fast_llama, "faster_own_rows", lambda linears, **_: 64)  # any CPU: every step below fits
    monkeypatch.setattr(fast_llama, "faster_plain_rows", lambda linear, **_: 0)
    monkeypatch.setattr(model_runner, "kernel_prefill_context", lambda *args, **kwargs: kernel_prefill)
    monkeypatch.setattr(loaded.model.model.layers[3].post_attention_layernorm, "variance_epsilon", 0.5)
    prompts = [[100 + (7 * j + 13 * i) % 5000 for j in range(9 + 23 * i)] for i in range(3)]  # 9, 32, 55 tokens
    runs = []
    for fuse in (True, False):
        cfg = EngineConfig(dtype=dtype, device="cpu", num_blocks=64, knobs=Knobs(
            max_num_seqs=3, max_num_batched_tokens=48, long_prefill_token_threshold=24, scheduling_policy=policy))
        engine = LLMEngine(cfg, loaded=loaded)
        engine.runner.fast.fuse_layers &= fuse
        runs.append(_step_logits(engine, prompts, max_tokens=12))
    return runs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy, kernel_prefill", [("continuous", 4096), ("continuous", 0), ("static", 4096)])
def test_layers_in_one_call_give_the_python_loops_logits_bit_for_bit(loaded_model, kernel, monkeypatch, dtype, policy,
                                                                    kernel_prefill):
    """decoder_layers runs the kernels the Python loop calls, in its order: every step's logits
    are equal to the bit, decode steps (static's padding rows among them) and prefill chunks the
    kernel attends run in one call, and chunks SDPA attends (kernel_prefill 0) go the loop's way."""
    (fused, in_one_call), (looped, in_loop) = _fused_and_looped(loaded_model, kernel, monkeypatch, dtype, policy,
                                                                kernel_prefill)
    assert in_loop == 0 and len(fused) == len(looped)
    assert all(torch.equal(a, b) for a, b in zip(fused, looped))
    if kernel_prefill:
        assert in_one_call == len(fused)  # every step: decode rows and the kernel's prefill chunks
    else:  # the chunks SDPA attends ran through the loop; the last prompt's 11 decode steps at least did not
        assert 11 <= in_one_call < len(fused)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layers_in_one_call_give_the_same_bits_alone_and_in_an_odd_team(loaded_model, kernel, monkeypatch, dtype):
    """The one call splits every kernel over its team (the GEMMs' panels, the elementwise
    kernels' rows, the attention's items as each thread claims them) with barriers between: alone,
    and in a team of 3 whose shares are uneven, every step's logits equal the loop's at that
    count and each other's."""
    before = torch.get_num_threads()
    fused_by_team = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            (fused, in_one_call), (looped, in_loop) = _fused_and_looped(loaded_model, kernel, monkeypatch, dtype,
                                                                        "continuous", 4096)
            assert in_loop == 0 and in_one_call == len(fused) == len(looped)
            assert all(torch.equal(a, b) for a, b in zip(fused, looped))
            fused_by_team.append(fused)
    finally:
        torch.set_num_threads(before)
    alone, odd_team = fused_by_team
    assert len(alone) == len(odd_team) and all(torch.equal(a, b) for a, b in zip(alone, odd_team))
