"""Owns the model and the paged KV cache; turns one schedule into ONE packed forward pass.

Packed layout of an iteration: decode rows first (one token each), then static padding rows
(computed and thrown away), then the prefill chunks the C attention kernel takes, then those SDPA
attends. No padding between sequences.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..model_loader import LoadedModel
from . import cpu_kernels, fast_llama, huge_pages
from .fast_llama import FastLlamaForward
from .paged_attention import (ATTN_IMPLEMENTATION, AttentionMetadata, BlockGather, DecodeGroup, KernelRows, PrefillSpan,
                              kernel_prefill_context, prefix_mask)
from .scheduler import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


def kv_cache_spec(loaded: LoadedModel) -> KVCacheSpec:
    cfg = loaded.model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return KVCacheSpec(cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", heads), head_dim, loaded.dtype)


@dataclass
class ForwardResult:
    """Logits (in the model's dtype) of the rows that need a token this iteration, row i for
    SchedulerOutput.scheduled[sample_indices[i]]."""

    logits: torch.Tensor  # [n, vocab]
    sample_indices: list[int]  # index into SchedulerOutput.scheduled for each logits row


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, fast_forward: bool = True,
                 use_kernels: bool = True):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.model.set_attn_implementation(ATTN_IMPLEMENTATION)  # registered in paged_attention
        self.spec = kv_cache_spec(loaded)
        wanted = use_kernels and cpu_kernels.CpuKernels.supports(loaded.dtype, self.device)
        self.kernels = kernels = cpu_kernels.load() if wanted else None  # None: torch paths throughout
        cfg = self.model.config
        attention_ok = kernels is not None and kernels.supports_attention(
            loaded.dtype, self.device, cfg.num_attention_heads, self.spec.num_kv_heads, self.spec.head_dim)
        self.attention_kernel = kernels if attention_ok else None
        # prefill chunks whose context reaches at most this far are attended by the kernel, the rest by SDPA
        self.kernel_prefill_context = kernel_prefill_context(
            kernels, loaded.dtype, cfg.num_attention_heads, self.spec.num_kv_heads, self.spec.head_dim,
            block_size) if attention_ok else 0
        self.fast = FastLlamaForward(self.model, kernels) if fast_forward and fast_llama.supports(self.model) else None
        log.info("forward: %s%s; attention: decode %s, prefill %s",
                 "lean llama forward" if self.fast else f"transformers {type(self.model).__name__}",
                 " with C elementwise kernels" if self.fast and kernels else "",
                 "by the C kernel over the paged cache" if self.attention_kernel else "by SDPA over gathered blocks",
                 f"by the C kernel up to a context of {self.kernel_prefill_context} tokens (it beat SDPA on this CPU), "
                 "beyond by SDPA" if self.kernel_prefill_context else "by SDPA")
        # One extra block at the end is scratch space for padding rows; it is never handed out.
        slots = (num_blocks + 1) * block_size
        self.scratch_slot = num_blocks * block_size
        shape = (self.spec.num_kv_heads, slots, self.spec.head_dim)  # head-major: see paged_attention
        layers = self.spec.num_layers
        if self.device.type == "cpu":  # 2 MB pages: fewer TLB misses over scattered blocks (huge_pages)
            caches = huge_pages.zeros([shape] * 2 * layers, loaded.dtype)
        else:
            caches = [torch.zeros(shape, dtype=loaded.dtype, device=self.device) for _ in range(2 * layers)]
        self.kv_caches = list(zip(caches[0::2], caches[1::2]))
        self._gather_buffers = (torch.empty(0, dtype=loaded.dtype, device=self.device),) * 2

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ForwardResult:
        """Run one packed forward over the scheduled tokens; return logits of sampling rows."""
        device = self.device
        decodes = [s for s in sched.scheduled if not s.is_prefill]
        prefills = [s for s in sched.scheduled if s.is_prefill]
        index_of = {id(item): i for i, item in enumerate(sched.scheduled)}

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        keep_rows: list[int] = []
        sample_indices: list[int] = []

        # Decode rows, longest context first (groups of similar length follow from it; the kernel's
        # dynamic schedule starts the longest first; the prefill rows it takes come after
        # them, short work over a context in cache): context = every computed token plus the new one.
        decodes.sort(key=lambda item: -item.seq.num_computed_tokens)
        ctx_lens: list[int] = []
        for item in decodes:
            seq = item.seq
            pos = seq.num_computed_tokens
            input_ids.append(seq.tokens(pos, pos + 1)[0])
            positions.append(pos)
            slot_mapping.extend(self._slots(seq.block_table, pos, pos + 1))
            ctx_lens.append(pos + 1)
        for _ in range(sched.padding_rows):
            input_ids.append(0)
            positions.append(0)
            slot_mapping.append(self.scratch_slot)
            ctx_lens.append(1)
        keep_rows.extend(range(len(decodes)))
        sample_indices.extend(index_of[id(item)] for item in decodes)

        tables = [item.seq.block_table for item in decodes] + [[]] * sched.padding_rows  # padding: scratch only
        groups = self._decode_groups(tables, ctx_lens) if self.attention_kernel is None else []

        def by_kernel(item) -> bool:
            return (self.attention_kernel is not None
                    and item.seq.num_computed_tokens + item.num_tokens <= self.kernel_prefill_context)

        prefills.sort(key=lambda item: not by_kernel(item))  # the kernel attends the first rows: its chunks first
        spans: list[PrefillSpan] = []
        for item in prefills:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed_tokens
            row = len(input_ids)
            input_ids.extend(seq.tokens(start, start + n))
            positions.extend(range(start, start + n))
            slot_mapping.extend(self._slots(seq.block_table, start, start + n))
            if by_kernel(item):  # the kernel's rows: one query per token over its context up to itself
                tables.extend([seq.block_table] * n)
                ctx_lens.extend(range(start + 1, start + n + 1))
            elif start > 0:
                width = -(-(start + n) // self.block_size)
                spans.append(PrefillSpan(row, n, self._block_gather([seq.block_table], width),
                                         prefix_mask(start, n, width * self.block_size, self.spec.dtype, self.device)))
            else:
                spans.append(PrefillSpan(row, n, None))
            if start + n == seq.num_tokens:  # context caught up: this row's logits give a token
                keep_rows.append(row + n - 1)
                sample_indices.append(index_of[id(item)])

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            decode_groups=groups,
            kernel_rows=self._kernel_rows(tables, ctx_lens, len(decodes) + sched.padding_rows)
            if self.attention_kernel is not None else None,
            prefills=spans,
            kv_caches=self.kv_caches,
            gather_buffers=self._buffers_for([g.context for g in groups] + [s.context for s in spans if s.context]),
            block_size=self.block_size,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        keep = torch.tensor(keep_rows, dtype=torch.long, device=device)
        if self.fast is not None:
            logits = self.fast(ids, pos, meta, keep)
        else:
            out = self.model(input_ids=ids[None], position_ids=pos[None], use_cache=False, logits_to_keep=keep, paged_meta=meta)
            logits = out.logits[0]
        return ForwardResult(logits, sample_indices)

    def _decode_groups(self, tables: list[list[int]], ctx_lens: list[int]) -> list[DecodeGroup]:
        """Block tables and validity masks of the decode rows (longest context first), cut into
        groups of similar length so that short contexts are not padded to the longest one."""
        bs = self.block_size
        groups = []
        for start, end in length_groups([-(-n // bs) for n in ctx_lens]):
            width = -(-ctx_lens[start] // bs)
            offsets = torch.arange(width * bs, device=self.device)
            lens = torch.tensor(ctx_lens[start:end], device=self.device)
            mask = (offsets.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
            groups.append(DecodeGroup(start, self._block_gather(tables[start:end], width), mask))
        return groups

    def _kernel_rows(self, tables: list[list[int]], ctx_lens: list[int], decode_rows: int) -> KernelRows | None:
        """Block tables and context lengths of the rows the C kernel attends (the first `decode_rows`
        decode and padding rows, then any prefill chunks' rows)."""
        if not ctx_lens:
            return None
        width = -(-max(ctx_lens) // self.block_size)
        return KernelRows(self.attention_kernel, self._padded_tables(tables, width),
                          torch.tensor(ctx_lens, dtype=torch.long, device=self.device), decode_rows)

    def _block_gather(self, tables: list[list[int]], width: int) -> BlockGather:
        """The first `width` blocks of each table (padded with the scratch block), for every KV head."""
        heads = torch.arange(self.spec.num_kv_heads, device=self.device) * (self.num_blocks + 1)
        return BlockGather((heads[:, None, None] + self._padded_tables(tables, width)).flatten(), len(tables), width)

    def _padded_tables(self, tables: list[list[int]], width: int) -> torch.Tensor:
        """[rows, width] int64: each table's first `width` blocks, padded with the scratch block (a
        table listed for many rows, as for a prefill chunk's, is converted once)."""
        scratch = [self.num_blocks] * width
        distinct: dict[int, int] = {}  # id of a table -> its row among the distinct ones
        padded: list[list[int]] = []
        rows = []
        for t in tables:
            if id(t) not in distinct:
                distinct[id(t)] = len(padded)
                padded.append((t[:width] + scratch)[:width])
            rows.append(distinct[id(t)])
        out = torch.tensor(padded, dtype=torch.long, device=self.device)
        return out if len(padded) == len(rows) else out[torch.tensor(rows, device=self.device)]

    def _buffers_for(self, gathers: list[BlockGather]) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch for the largest of this step's gathers; kept (and only grown) across steps."""
        need = max((g.index.numel() for g in gathers), default=0) * self.block_size * self.spec.head_dim
        if need > self._gather_buffers[0].numel():
            self._gather_buffers = tuple(torch.empty(need, dtype=self.spec.dtype, device=self.device) for _ in range(2))
        return self._gather_buffers


def length_groups(blocks: list[int], slack: int = 4) -> list[tuple[int, int]]:
    """Cut rows sorted by context blocks (longest first) into [start, end) groups. A row joins
    the current group while padding it to the group's longest row at most doubles its work or
    adds at most `slack` blocks; otherwise it starts a new group."""
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or (2 * blocks[i] < blocks[start] and blocks[start] - blocks[i] > slack):
            groups.append((start, i))
            start = i
    return groups
