"""Prefill attention over the paged cache against dense SDPA on the same context (no model), by
both paths: SDPA, where a chunk after a cached prefix attends whole blocks with the last block's
tail masked, whatever that tail holds; and the C kernel, where each of the chunk's rows is a query
over its sequence's slots up to itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from appliance.engine import cpu_kernels
from appliance.engine.paged_attention import (AttentionMetadata, BlockGather, KernelRows, PrefillSpan, kernel_prefill_context,
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
def test_a_chunk_attends_its_prefix_and_itself_and_nothing_past_its_context(request, path, dtype, tolerance, prefix,
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
        meta.kernel_rows = KernelRows(request.getfixturevalue("kernels"), torch.tensor([table] * chunk),
                                      torch.arange(prefix + 1, ctx + 1), 0)
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


@pytest.mark.parametrize("wins_up_to, expected", [(4096, 4096), (1024, 1024), (512, 512), (0, 0)])
def test_the_kernel_takes_prefill_up_to_the_longest_context_where_it_kept_winning(kernels, monkeypatch, wins_up_to,
                                                                                  expected):
    from appliance.engine import paged_attention

    timed = []
    monkeypatch.setattr(paged_attention, "_KERNEL_PREFILL", {})
    monkeypatch.setattr(paged_attention, "_kernel_wins",
                        lambda *args: timed.append(args[-1]) or args[-1] <= wins_up_to or args[-1] == 4096)
    assert kernel_prefill_context(kernels, torch.float32, HEADS, KV_HEADS, DIM, BLOCK) == expected
    contexts = paged_attention.PROBE_CONTEXTS
    first_loss = [c for c in contexts if c > expected][:1]  # counting stops there: a win at 4096 after it is moot
    probed = [c for c in contexts if c <= expected] + first_loss
    assert timed == probed
    assert kernel_prefill_context(kernels, torch.float32, HEADS, KV_HEADS, DIM, BLOCK) == expected
    assert len(timed) == len(probed)  # timed once a process
    kernel_prefill_context(kernels, torch.bfloat16, HEADS, KV_HEADS, DIM, BLOCK)
    assert len(timed) > len(probed)  # another dtype: timed on its own


@pytest.mark.parametrize("context", [256, 1024])  # a chunk alone; one after a prefix
@pytest.mark.parametrize("kernel_s, sdpa_s, chosen", [(1.0, 2.0, True), (2.0, 2.0, True), (2.5, 2.0, False)])
def test_the_prefill_timing_runs_both_paths_and_takes_the_faster(kernels, monkeypatch, context, kernel_s, sdpa_s,
                                                                 chosen):
    from appliance.engine import paged_attention

    ran = []

    def scripted(fns, **_):
        ran.extend(fn() for fn in fns)  # each real path, once
        return [kernel_s, sdpa_s]

    monkeypatch.setattr(paged_attention, "best_times", scripted)
    assert paged_attention._kernel_wins(kernels, torch.float32, HEADS, KV_HEADS, DIM, 5, context) is chosen  # 5: no divisor
    by_kernel, by_sdpa = ran
    assert by_kernel.shape == (paged_attention.PROBE_CHUNK, HEADS, DIM)
    assert torch.allclose(by_kernel, by_sdpa, atol=1e-4)  # the two paths timed attend alike
