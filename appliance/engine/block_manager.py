"""Paged KV cache bookkeeping: fixed-size blocks, free lists, reference counts, block tables, and
automatic prefix caching.

The K/V tensors themselves live in the model runner; this class only decides which block ids a
sequence owns. Invariant: free + used == total at every moment.

Prefix caching: a full block whose tokens have been computed is named by a chain hash of (its
parent block's hash, its token ids), so equal hashes mean equal whole prefixes. Sequences whose
first k blocks of tokens agree share those k physical blocks (reference counts > 1); only full
blocks are shared, the partial last block is always private. A block whose count drops to 0 keeps
its contents and hash: it is "cached free", still counted as free, and reused by a later match or,
when no never-used free block is left, evicted least recently used first. A block held by any
sequence (count > 0) is never on a free list, so it is never evicted or handed out again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from .sequence import Sequence

_ROOT = b""  # the parent hash of a sequence's first block


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Chain hash of one full block: SHA-256 of the parent's hash and the block's token ids."""
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))  # free blocks without a hash
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # count 0, hash kept; LRU first
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> its hash, for cached blocks only
        self._block_of: dict[bytes, int] = {}  # hash -> the one block holding it

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: never-used ones plus cached-free ones."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (reclaimable, evicted LRU)."""
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block: int) -> int:
        """How many sequences hold `block` in their block tables."""
        return self._ref_counts[block]

    def is_cached(self, block: int) -> bool:
        """True if `block` holds a cached prefix (a later prompt may match it)."""
        return block in self._hash_of

    # -- prefix caching -------------------------------------------------------------------------
    def set_caching(self, enabled: bool) -> None:
        """Turn matching and caching on or off. Off forgets every hash: cached-free blocks become
        ordinary free blocks and blocks in use become private."""
        if enabled == self.enable_caching:
            return
        self.enable_caching = enabled
        if not enabled:
            self._free.extend(self._cached_free)
            self._cached_free.clear()
            self._hash_of.clear()
            self._block_of.clear()

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chain hashes of `seq`'s first `num_blocks` full blocks of tokens, each computed once."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if hashes else _ROOT, seq.tokens(i * bs, (i + 1) * bs)))
        return hashes

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the cached blocks that hold its longest cached prefix of
        full blocks (never all its tokens: the last one is always computed). Returns the number of
        tokens matched, now counted as computed."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_caching:
            return 0
        matched: list[int] = []
        for h in self._hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block = self._block_of.get(h)
            if block is None:
                break
            matched.append(block)
        for block in matched:
            if self._ref_counts[block] == 0:
                del self._cached_free[block]
            self._ref_counts[block] += 1
        seq.block_table = matched
        seq.num_cached_blocks = len(matched)
        seq.num_computed_tokens = len(matched) * self.block_size
        return seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of `seq`'s blocks that filled with computed tokens since the last call.
        A block whose hash another block already holds stays private (one block per hash)."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if not self.enable_caching or full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_cached_blocks, full):
            block = seq.block_table[i]
            if hashes[i] not in self._block_of and block not in self._hash_of:
                self._block_of[hashes[i]] = block
                self._hash_of[block] = hashes[i]
        seq.num_cached_blocks = full

    # -- allocation -----------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs to hold its computed tokens plus `num_new_tokens` more."""
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow `seq`'s block table to cover `num_new_tokens` more tokens; False if out of blocks.
        Never-used free blocks go first, then cached-free ones, least recently used first."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached_free.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`, first caching the blocks it filled. Freed in reverse order,
        so a shared prefix's first blocks are evicted last and plain blocks reused first."""
        self.cache_full_blocks(seq)
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if block in self._hash_of:
                    self._cached_free[block] = None  # most recently used end
                else:
                    self._free.appendleft(block)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def check_invariants(self) -> None:
        """Raise AssertionError if the free lists, reference counts and hash maps disagree."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & set(self._cached_free), "a block is both plain free and cached free"
        for block, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block} has a negative reference count"
            on_a_list = block in free or block in self._cached_free
            assert (count == 0) == on_a_list, f"block {block}: refcount {count} vs free lists"
            if block in self._cached_free:
                assert block in self._hash_of, f"cached-free block {block} has no hash"
        assert len(self._block_of) == len(self._hash_of), "a hash maps to more than one block"
        for h, block in self._block_of.items():
            assert self._hash_of.get(block) == h, f"hash of block {block} disagrees with the map"
        assert not free & set(self._hash_of), "a plain free block still has a hash"
