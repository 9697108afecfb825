"""Paged attention plugged into transformers through its attention interface.

transformers' attention modules project and rotate q/k/v for the packed tokens of one iteration
(batch dimension 1, no padding) and call the registered function. This function writes the new
keys and values into the engine's block-paged cache (slot mapping) and attends each token to its
own sequence's cached context:

- with the C kernels (cpu_kernels), every row as one query at its position over its sequence's
  cached slots up to it, read in place (in bf16 with AVX512-BF16, a prefill chunk's context copied
  once into tiles its rows share): decode rows, and the rows of prefill chunks whose context
  is short enough that the kernel attends them faster than SDPA on this CPU
  (`kernel_prefill_context`: a chunk's rows share their block table, each sees one slot more than
  the row before, which is the causal mask);
- else decode rows in a few batched SDPA calls, one per group of similar context length, over
  contexts gathered block by block; and the other prefill chunks one sequence at a time, causal
  within the chunk and over the cached prefix.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from appliance.numeric import best_times

from .cpu_kernels import CpuKernels

ATTN_IMPLEMENTATION = "appliance_paged"


@dataclass
class BlockGather:
    """Cache blocks to copy out, for every KV head, into a dense [rows, KVH, width * block_size, dim]
    context: `index` lists rows of the cache viewed as [KVH * blocks, block_size * dim], head-major
    (every row's blocks for head 0, then for head 1, ...), so one index_select on dim 0 moves
    whole blocks (contiguous runs of block_size * dim values)."""

    index: torch.Tensor  # [KVH * rows * width]
    rows: int
    width: int  # blocks per row (shorter rows are padded with the scratch block)


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the packed batch
    length: int  # tokens in this chunk
    context: BlockGather | None  # blocks of the whole context (prefix + chunk); None if no prefix
    # with a prefix: [length, context blocks * block_size], 0 where a row may attend (the cached
    # prefix and the chunk up to itself), -inf elsewhere (later rows, the last block's tail)
    mask: torch.Tensor | None = None


@dataclass
class DecodeGroup:
    """Decode rows of similar context length, attended together in one SDPA call."""

    start: int  # first row of the group in the packed batch
    context: BlockGather  # each row's blocks, padded with the scratch block to the group's width
    mask: torch.Tensor  # [n, 1, 1, width * block_size] True where a slot holds real context


@dataclass
class KernelRows:
    """The first `rows` packed rows, attended by the C kernel in one call, each a query over its
    sequence's first `ctx_lens[i]` cached slots: the decode and padding rows, then the rows of the
    prefill chunks it takes (`kernel_prefill_context`; a chunk's row at position p sees slots 0..p)."""

    kernels: CpuKernels
    block_tables: torch.Tensor  # [rows, width] int64, padded with the scratch block
    ctx_lens: torch.Tensor  # [rows] int64
    decode_rows: int  # the first rows, decode and padding: each reads a context of its own (prefetched)

    @property
    def rows(self) -> int:
        return self.ctx_lens.shape[0]


@dataclass
class AttentionMetadata:
    """Everything the attention function needs for one iteration (built once, used by all layers)."""

    slot_mapping: torch.Tensor  # [T] cache slot of each packed token
    decode_groups: list[DecodeGroup]  # the decode rows, cut into groups of similar context length
    kernel_rows: KernelRows | None  # or, with the C kernel, the decode rows (and prefill rows) at once (groups empty)
    prefills: list[PrefillSpan]  # the chunks SDPA attends (none where the kernel takes them)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V as [kv_heads, slots, dim]
    gather_buffers: tuple[torch.Tensor, torch.Tensor]  # flat scratch for K and V contexts, reused by every gather
    block_size: int = 16


def prefix_mask(start: int, n: int, length: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A chunk's additive attention mask over `length` cached slots (PrefillSpan.mask): the chunk's
    row at position p sees slots 0..p. Built once per step for every layer (a bool mask would be
    converted by each layer's SDPA call)."""
    rows = torch.arange(start, start + n, device=device).unsqueeze(1)
    hidden = torch.arange(length, device=device).unsqueeze(0) > rows
    return torch.zeros(n, length, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


def _gather(cache: torch.Tensor, context: BlockGather, buffer: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [KVH, slots, dim] -> context [rows, KVH, width * block_size, dim], copied into `buffer`.

    Written into a buffer that lives across layers and steps (no fresh pages to fault in per
    call), by an index_select on dim 0 (memcpy of whole blocks; on other dims it copies element by
    element). The result is a view whose every (row, head) matrix is contiguous, as SDPA wants."""
    kv_heads, _, head_dim = cache.shape
    block = block_size * head_dim
    out = buffer[: context.index.numel() * block].view(-1, block)
    torch.index_select(cache.view(-1, block), 0, context.index, out=out)
    return out.view(kv_heads, context.rows, context.width * block_size, head_dim).transpose(0, 1)


def kernel_scale(scaling: float | None, head_dim: int) -> float:
    """The score scale the C kernels take: the layer's `scaling`, else SDPA's default 1/sqrt(head_dim)."""
    return scaling if scaling is not None else head_dim**-0.5


def paged_attention(
    layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scaling: float | None
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] of the packed new tokens -> attention output [T, H, D]."""
    k_cache, v_cache = meta.kv_caches[layer_idx]
    k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    total, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    out = q.new_empty(total, num_heads, head_dim)
    k_buf, v_buf = meta.gather_buffers
    if meta.kernel_rows is not None:
        by_kernel = meta.kernel_rows
        by_kernel.kernels.paged_attend(q[: by_kernel.rows], k_cache, v_cache, by_kernel.block_tables, by_kernel.ctx_lens,
                                       meta.block_size, kernel_scale(scaling, head_dim), out[: by_kernel.rows],
                                       cold_rows=by_kernel.decode_rows)
    for group in meta.decode_groups:
        # The query heads that share a KV head become extra "query rows": no KV repeat needed.
        n = group.context.rows
        rows = slice(group.start, group.start + n)
        q_dec = q[rows].reshape(n, kv_heads, num_heads // kv_heads, head_dim)
        k_dec = _gather(k_cache, group.context, k_buf, meta.block_size)  # [n, KVH, L, dim]
        v_dec = _gather(v_cache, group.context, v_buf, meta.block_size)
        o = F.scaled_dot_product_attention(q_dec, k_dec, v_dec, attn_mask=group.mask, scale=scaling)
        out[rows] = o.reshape(n, num_heads, head_dim)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.length)
        q_p = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if span.context is None:
            k_p = k[rows].transpose(0, 1).unsqueeze(0)
            v_p = v[rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q_p, k_p, v_p, is_causal=True, scale=scaling, enable_gqa=True)
        else:  # whole blocks, the tail masked: SDPA's CPU kernel runs ~15 % faster on such lengths
            k_p = _gather(k_cache, span.context, k_buf, meta.block_size)  # [1, KVH, blocks * block_size, D]
            v_p = _gather(v_cache, span.context, v_buf, meta.block_size)
            o = F.scaled_dot_product_attention(q_p, k_p, v_p, attn_mask=span.mask, scale=scaling, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out


PROBE_CHUNK = 256  # rows of the prefill chunk the kernel and SDPA are timed on
PROBE_CONTEXTS = (256, 512, 1024, 2048, 4096)  # the chunk's context: the chunk, after a prefix of the rest
_KERNEL_PREFILL: dict[tuple, int] = {}  # kernel_prefill_context per dtype, heads, head size, block size, threads


def kernel_prefill_context(kernels: CpuKernels, dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int,
                           block_size: int = 16) -> int:
    """The longest context (of PROBE_CONTEXTS, counting up while the kernel keeps winning; 0 where
    it loses at the first) up to which the C kernel attends a prefill chunk in at most the time
    SDPA takes, both timed through `paged_attention` on a 256-row chunk over scattered blocks of a
    paged cache. Timed once a process per dtype, head counts, head size, block size and thread
    count (0.05-0.3 s). The kernel reads each row's context anew (in bfloat16 with AVX512-BF16 it
    tiles a chunk's context once for all its rows) where SDPA's CPU flash kernel blocks rows
    together, so short contexts favour the kernel and long ones SDPA (on an AMD EPYC
    Zen 5, before the tiled path: a causal 256-row chunk 2x faster by the kernel in bfloat16, 1.5x
    in float32; this answered 2048-4096 in bfloat16, 512-2048 in float32; with it, 4096 in bfloat16)."""
    key = (dtype, num_heads, kv_heads, head_dim, block_size, torch.get_num_threads())
    if key not in _KERNEL_PREFILL:
        won = 0
        for context in PROBE_CONTEXTS:
            if not _kernel_wins(kernels, dtype, num_heads, kv_heads, head_dim, block_size, context):
                break
            won = context
        _KERNEL_PREFILL[key] = won
    return _KERNEL_PREFILL[key]


def _kernel_wins(kernels: CpuKernels, dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int,
                 block_size: int, context: int) -> bool:
    """Whether the kernel attends a PROBE_CHUNK-row chunk ending at `context` in at most SDPA's time."""
    prefix, chunk = context - PROBE_CHUNK, PROBE_CHUNK
    width = -(-context // block_size)
    gen = torch.Generator().manual_seed(0)
    caches = [tuple(torch.randn(kv_heads, (2 * width + 1) * block_size, head_dim, generator=gen).to(dtype)
                    for _ in range(2))]
    table = torch.randperm(2 * width, generator=gen)[:width]  # scattered blocks
    positions = torch.arange(prefix, context)
    slots = table[positions // block_size] * block_size + positions % block_size
    q, k, v = (torch.randn(chunk, h, head_dim, generator=gen).to(dtype) for h in (num_heads, kv_heads, kv_heads))
    heads = torch.arange(kv_heads) * (2 * width + 1)
    gather = BlockGather((heads[:, None, None] + table[None, :]).flatten(), 1, width) if prefix else None
    span = PrefillSpan(0, chunk, gather, prefix_mask(prefix, chunk, width * block_size, dtype, "cpu") if prefix else None)
    buffers = tuple(torch.empty(kv_heads * width * block_size * head_dim, dtype=dtype) for _ in range(2))
    rows = KernelRows(kernels, table.expand(chunk, width).contiguous(), torch.arange(prefix + 1, context + 1), 0)
    by_kernel = AttentionMetadata(slots, [], rows, [], caches, buffers, block_size)
    by_sdpa = AttentionMetadata(slots, [], None, [span], caches, buffers, block_size)
    with torch.inference_mode():
        kernel_s, sdpa_s = best_times([functools.partial(paged_attention, 0, q, k, v, meta, None)
                                       for meta in (by_kernel, by_sdpa)], repeats=3, calls=1)
    return kernel_s <= sdpa_s


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_meta: AttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [1, H, T, D], key/value [1, KVH, T, D] ->
    ([1, T, H, D], None)."""
    if paged_meta is None:  # called outside the engine (e.g. plain `generate`): behave like sdpa
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    out = paged_attention(
        module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), paged_meta, scaling
    )
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
