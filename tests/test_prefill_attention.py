"""Prefill attention over the paged cache against dense SDPA on the same context (no model), by
both paths: SDPA, where a chunk after a cached prefix attends whole blocks with the last block's
tail masked, whatever that tail holds; and the C kernel, where each of the chunk's rows is a query
over its sequence's slots up to itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from appliance.engine import cpu_kernels
from appliance.engine.paged_attention import (AttentionMetadata, BlockGather, KernelRows, PrefillSpan, kernel_prefill_faster,
                                              paged_attention, prefix_mask)

HEADS, KV_HEADS, DIM, BLOCK, BLOCKS = 6, 2, 16, 4, 12


@pytest.fixture(scope="module")
def kernels():
    built = cpu_kernels.load()
    assert built is not None, "gcc is on every machine we test on"
    return built


@pytest.mark.parametrize("path", ["sdpa", "kernel"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("prefix, chunk", [(8, 5), (5, 6), (12, 4), (0, 7)])
def test_a_chunk_attends_its_prefix_and_itself_and_nothing_past_its_context(kernels, path, dtype, tolerance, prefix,
                                                                             chunk):
    torch.manual_seed(0)
    ctx = prefix + chunk
    table = [7, 2, 9, 4, 0, 11][: -(-ctx // BLOCK)]  # scattered blocks
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)])
    # every slot holds something, the tail of the last block too (another sequence's stale keys)
    k_cache = (torch.randn(KV_HEADS, (BLOCKS + 1) * BLOCK, DIM) * 8).to(dtype)
    v_cache = (torch.randn(KV_HEADS, (BLOCKS + 1) * BLOCK, DIM) * 8).to(dtype)
    keys, values = torch.randn(ctx, KV_HEADS, DIM).to(dtype), torch.randn(ctx, KV_HEADS, DIM).to(dtype)
    k_cache[:, slots[:prefix]] = keys[:prefix].transpose(0, 1)  # the cached prefix
    v_cache[:, slots[:prefix]] = values[:prefix].transpose(0, 1)
    q = torch.randn(chunk, HEADS, DIM).to(dtype)
    width = len(table)
    heads = torch.arange(KV_HEADS) * (BLOCKS + 1)
    gather = BlockGather((heads[:, None, None] + torch.tensor([table])).flatten(), 1, width) if prefix else None
    span = PrefillSpan(0, chunk, gather, prefix_mask(prefix, chunk, width * BLOCK, dtype, "cpu") if prefix else None)
    buffers = tuple(torch.empty(KV_HEADS * width * BLOCK * DIM, dtype=dtype) for _ in range(2))
    meta = AttentionMetadata(slot_mapping=slots[prefix:], decode_groups=[], kernel_rows=None, prefills=[span],
                             kv_caches=[(k_cache, v_cache)], gather_buffers=buffers, block_size=BLOCK)
    if path == "kernel":  # the chunk's rows share its table; row j sees prefix + j + 1 slots
        meta.prefills = []
        meta.kernel_rows = KernelRows(kernels, torch.tensor([table] * chunk), torch.arange(prefix + 1, ctx + 1), 0)
    out = paged_attention(0, q, keys[prefix:], values[prefix:], meta, None)

    causal = torch.arange(ctx)[None, :] <= torch.arange(prefix, ctx)[:, None]
    expected = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys.float().transpose(0, 1)[None],
                                              values.float().transpose(0, 1)[None], attn_mask=causal,
                                              enable_gqa=True)[0].transpose(0, 1)
    assert (out.float() - expected).abs().max().item() < tolerance * max(1.0, expected.abs().max().item())


def test_the_prefix_mask_hides_later_rows_and_the_tail():
    mask = prefix_mask(3, 2, 8, torch.float32, "cpu")
    assert mask.shape == (2, 8)
    assert (mask == 0).tolist() == [[True] * 4 + [False] * 4, [True] * 5 + [False] * 3]
    assert torch.isneginf(mask[mask != 0]).all()


def test_the_prefill_path_is_timed_once_a_process(kernels, monkeypatch):
    from appliance.engine import paged_attention

    calls = []
    monkeypatch.setattr(paged_attention, "_KERNEL_PREFILL", {})
    monkeypatch.setattr(paged_attention, "_time_prefill", lambda *args: calls.append(args) or True)
    assert kernel_prefill_faster(kernels, torch.float32, HEADS, KV_HEADS, DIM, BLOCK)
    assert kernel_prefill_faster(kernels, torch.float32, HEADS, KV_HEADS, DIM, BLOCK)
    assert len(calls) == 1
    kernel_prefill_faster(kernels, torch.bfloat16, HEADS, KV_HEADS, DIM, BLOCK)
    assert len(calls) == 2  # another dtype is timed on its own


@pytest.mark.parametrize("kernel_s, sdpa_s, chosen", [(1.0, 2.0, True), (2.0, 2.0, True), (2.5, 2.0, False)])
def test_the_prefill_timing_runs_both_paths_and_takes_the_faster(kernels, monkeypatch, kernel_s, sdpa_s, chosen):
    from appliance.engine import paged_attention

    ran = []

    def scripted(fns, **_):
        ran.extend(fn() for fn in fns)  # each real path, once: [outputs of every probe chunk]
        return [kernel_s, sdpa_s]

    monkeypatch.setattr(paged_attention, "best_times", scripted)
    assert paged_attention._time_prefill(kernels, torch.float32, HEADS, KV_HEADS, DIM, 5) is chosen  # 5: not a divisor
    by_kernel, by_sdpa = ran
    assert len(by_kernel) == len(paged_attention.PREFILL_PROBE)
    for a, b in zip(by_kernel, by_sdpa):  # the two paths timed attend alike
        assert torch.allclose(a, b, atol=1e-4)
