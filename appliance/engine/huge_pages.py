"""Long-lived CPU tensors on 2 MB pages: the paged KV cache and the packed weights.

A decode step reads the packed weights once and each row's cached blocks, a few KB each, scattered
over a cache of about a GiB: with 4 KB pages nearly every block and every 4 KB of weights costs a
TLB miss and a page walk. Linux backs memory with 2 MB pages where a program asks (madvise
MADV_HUGEPAGE, transparent huge pages in "madvise" or "always" mode) before the memory is first
touched. torch can do that for every allocation (THP_MEM_ALLOC_ENABLE=1, read once before its first
allocation), but then each step's short-lived activations fault in and zero whole 2 MB pages, which
cost more than they save (skewed-48 in float32 ran 0.93-0.98x); here only the tensors that live as
long as the engine are placed on them, in mappings of their own (the advice ends with them).
Elsewhere (no Linux, THP not built in) the mappings get ordinary pages.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import sys
from typing import Sequence

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 4096  # each tensor in an arena starts on a 4 KB boundary


def _madvise():
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _madvise()


def arena(nbytes: int, fault_in: bool = True) -> torch.Tensor:
    """`nbytes` of zeroed CPU memory (uint8) in a mapping of its own, starting on a 2 MB boundary,
    asked to be backed by 2 MB pages before any of it is touched; `fault_in`: every page touched
    now (not by the engine's steps), else by the caller's first writes."""
    length = math.ceil(max(nbytes, 1) / HUGE_PAGE) * HUGE_PAGE
    # private: a shared anonymous mapping (mmap's default) is shmem, whose huge pages follow
    # shmem_enabled (often "never"); Windows has no flags, and its anonymous maps are private
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}
    mapping = torch.frombuffer(mmap.mmap(-1, length + HUGE_PAGE, **private), dtype=torch.uint8)  # keeps it alive
    start = -mapping.data_ptr() % HUGE_PAGE
    memory = mapping[start : start + length]
    if _MADVISE is not None and _MADVISE(memory.data_ptr(), length, mmap.MADV_HUGEPAGE) != 0:
        log.info("madvise(MADV_HUGEPAGE) failed (errno %d): the KV cache and weights stay on 4 KB pages",
                 ctypes.get_errno())
    return memory[:nbytes].zero_() if fault_in else memory[:nbytes]


def zeros(shapes: Sequence[Sequence[int]], dtype: torch.dtype, fault_in: bool = True) -> list[torch.Tensor]:
    """Zero-filled contiguous CPU tensors of `shapes`, side by side in one arena on 2 MB pages
    (`fault_in` False where the caller overwrites them at once: see `arena`)."""
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += math.ceil(size / ALIGN) * ALIGN
    memory = arena(end, fault_in)
    return [memory[o : o + n].view(dtype).view(*shape) for o, n, shape in zip(offsets, sizes, shapes)]
