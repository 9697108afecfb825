"""Prefill attention over the paged cache against dense SDPA on the same context (no model): a
chunk after a cached prefix attends whole blocks with the last block's tail masked, whatever
that tail holds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from appliance.engine.paged_attention import AttentionMetadata, BlockGather, PrefillSpan, paged_attention, prefix_mask

HEADS, KV_HEADS, DIM, BLOCK, BLOCKS = 6, 2, 16, 4, 12


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("prefix, chunk", [(8, 5), (5, 6), (12, 4), (0, 7)])
def test_a_chunk_attends_its_prefix_and_itself_and_nothing_past_its_context(dtype, tolerance, prefix, chunk):
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
    meta = AttentionMetadata(slot_mapping=slots[prefix:], decode_groups=[], kernel_decode=None, prefills=[span],
                             kv_caches=[(k_cache, v_cache)], gather_buffers=buffers, block_size=BLOCK)
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
