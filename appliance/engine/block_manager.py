"""Paged KV cache bookkeeping: fixed-size blocks, a free list, reference counts, block tables.

The K/V tensors themselves live in the model runner; this class only decides which block ids a
sequence owns. Invariant: free + used == total at every moment.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs to hold its computed tokens plus `num_new_tokens` more."""
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow `seq`'s block table to cover `num_new_tokens` more tokens; False if out of blocks."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (newest first, so they are reused last-in-first-out)."""
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.appendleft(block)
        seq.block_table = []

    def check_invariants(self) -> None:
        """Raise AssertionError if the free list and reference counts disagree."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block} has a negative reference count"
            assert (count == 0) == (block in free), f"block {block}: refcount {count} vs free list"
