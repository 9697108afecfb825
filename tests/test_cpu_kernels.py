"""The C kernels against torch: paged decode attention vs dense SDPA, elementwise ops vs the
lean forward's (transformers') torch ops, in float32 and bfloat16."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from appliance.engine import cpu_kernels, fast_llama


@pytest.fixture(scope="module")
def kernel():
    built = cpu_kernels.load()
    assert built is not None, "the kernels must build wherever the tests run (gcc is installed there)"
    return built


def test_loading_the_kernels_keeps_subnormal_floats(kernel):
    # A library linked with -ffast-math would switch the whole process to flush-to-zero.
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 1.0).item() > 0
    value = 5e-324
    assert value * 1.0 > 0


def _case(dtype, heads: int, kv_heads: int, head_dim: int, block_size: int, ctx_lens: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in ctx_lens) + 3
    k_cache = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(ctx_lens), heads, head_dim, generator=gen).to(dtype)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)  # scattered blocks, as after many allocations and frees
    tables = []
    for n in ctx_lens:
        tables.append([free.pop() for _ in range(-(-n // block_size))])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables], dtype=torch.long)
    return q, k_cache, v_cache, tables, block_tables


def _reference(q, k_cache, v_cache, tables, ctx_lens, block_size, scale):
    rows = []
    for i, (table, n) in enumerate(zip(tables, ctx_lens)):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        k, v = k_cache[:, slots].float(), v_cache[:, slots].float()  # [KVH, n, D]
        o = F.scaled_dot_product_attention(q[i].float()[None, :, None], k[None], v[None], scale=scale, enable_gqa=True)
        rows.append(o[0, :, 0])
    return torch.stack(rows)


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,block_size,ctx_lens",
    [
        (torch.float32, 9, 3, 64, 16, [1, 15, 16, 17, 33, 100, 257]),  # the default model's shape
        (torch.float32, 4, 4, 32, 4, [3, 64, 65]),  # no grouping, small blocks
        (torch.float32, 8, 2, 128, 16, [1, 50, 129]),  # the other head size with its own copy
        (torch.float32, 8, 1, 80, 5, [7, 31, 32, 96]),  # one KV head for all, odd block size and dim
        (torch.bfloat16, 9, 3, 64, 16, [2, 40, 300]),
    ],
)
def test_kernel_matches_dense_attention(kernel, dtype, heads, kv_heads, head_dim, block_size, ctx_lens):
    q, k_cache, v_cache, tables, block_tables = _case(dtype, heads, kv_heads, head_dim, block_size, ctx_lens)
    assert kernel.supports_attention(dtype, torch.device("cpu"), heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    out = torch.empty_like(q)
    kernel.paged_decode(q, k_cache, v_cache, block_tables, torch.tensor(ctx_lens), block_size, scale, out)
    expected = _reference(q, k_cache, v_cache, tables, ctx_lens, block_size, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_paged_decode_reads_strided_queries(kernel):
    # q as the lean forward hands it over: a view into the fused qkv projection's output
    q, k_cache, v_cache, tables, block_tables = _case(torch.float32, 9, 3, 64, 16, [5, 70])
    fused = torch.cat([q.reshape(2, -1), torch.randn(2, 384)], dim=1)
    view = fused[:, : 9 * 64].view(2, 9, 64)
    out = torch.empty_like(q)
    kernel.paged_decode(view, k_cache, v_cache, block_tables, torch.tensor([5, 70]), 16, 0.125, out)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, tables, [5, 70], 16, 0.125), atol=1e-5, rtol=1e-5)


def test_kernel_declines_what_it_cannot_run(kernel):
    cpu = torch.device("cpu")
    assert not kernel.supports_attention(torch.float16, cpu, 9, 3, 64)
    assert not kernel.supports_attention(torch.float32, cpu, 9, 3, kernel.max_dim + 1)
    assert not kernel.supports_attention(torch.float32, cpu, 10, 3, 64)  # heads not a multiple of KV heads
    assert not kernel.supports_attention(torch.float32, torch.device("meta"), 9, 3, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 40])  # below and above the kernels' threading threshold
def test_elementwise_kernels_match_torch(kernel, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    weight = torch.rand(576, generator=gen).to(dtype)
    torch.testing.assert_close(kernel.rms_norm(x, weight, 1e-5), fast_llama._rms_norm(x, weight, 1e-5), **tol)

    gate_up = torch.randn(rows, 2 * 96, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernel.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, **tol)

    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.rand(rows, dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    expected = qkv.clone()
    rotated = heads + kv_heads  # q's and k's heads; v's stay as they are
    expected[:, : rotated * dim] = fast_llama._rotate(
        qkv[:, : rotated * dim].view(rows, rotated, dim), cos.unsqueeze(1), sin.unsqueeze(1)).reshape(rows, -1)
    kernel.rotary_(qkv, rotated, dim, cos, sin)
    torch.testing.assert_close(qkv, expected, **tol)


def test_cli_flag_and_config_reach_the_engine_config():
    from appliance.cli import build_parser
    from appliance.settings import engine_config_from_args

    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["generate", "hi"])).cpu_kernels is True  # configs/default.toml
    assert engine_config_from_args(parser.parse_args(["generate", "--no-cpu-kernels", "hi"])).cpu_kernels is False


def test_bfloat16_engine_agrees_with_its_torch_path():
    # bf16 is what `--dtype auto` picks on CPUs with native bf16 (this one). Rounding differs
    # between the two paths, so greedy tokens may part ways after a near-tie; a broken kernel
    # would part them at once. Measured here: 94 % of tokens before the first divergence.
    from appliance.engine import EngineConfig, Knobs, LLMEngine, SamplingParams
    from appliance.model_loader import load_model

    from test_engine_parity import PROMPTS

    loaded = load_model(dtype="bfloat16", device="cpu")
    outputs = {}
    for kernels in (True, False):
        engine = LLMEngine(EngineConfig(dtype="bfloat16", device="cpu", num_blocks=256, cpu_kernels=kernels,
                                        knobs=Knobs(max_num_seqs=16, max_num_batched_tokens=1024,
                                                    long_prefill_token_threshold=1024)), loaded=loaded)
        assert (engine.runner.decode_kernel is not None) == kernels
        params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
        outputs[kernels] = [o.token_ids for o in engine.generate(PROMPTS, params)]
    common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(outputs[True], outputs[False])]
    assert all(n >= 1 for n in common), common  # the first token (from the prefill) always agrees
    assert sum(common) >= 0.75 * 16 * len(PROMPTS), common
