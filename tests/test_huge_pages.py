"""appliance.engine.huge_pages: the engine's long-lived CPU tensors (KV cache, packed weights) in
arenas asked to be backed by 2 MB pages. Whether the kernel grants 2 MB pages is its choice (THP
mode, fragmentation); what is checked is the layout and that the request reached the kernel."""

from pathlib import Path

import pytest
import torch

from appliance.engine import huge_pages

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # present where the kernel has THP


def _vma_flags(address: int) -> list[str]:
    """VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeros_lie_side_by_side_in_one_aligned_arena_and_are_zero():
    shapes = [(3, 1000, 64), (3, 1000, 64), (5, 7)]
    tensors = huge_pages.zeros(shapes, torch.bfloat16)
    assert [tuple(t.shape) for t in tensors] == shapes
    assert all(t.is_contiguous() and t.dtype == torch.bfloat16 and not t.any() for t in tensors)
    starts = [t.data_ptr() for t in tensors]
    assert starts[0] % huge_pages.HUGE_PAGE == 0
    assert all(s % huge_pages.ALIGN == 0 for s in starts)
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in tensors]
    assert all(end <= start for end, start in zip(ends, starts[1:]))  # no overlap, in order
    tensors[0].fill_(1)
    assert not tensors[1].any() and not tensors[2].any()  # writing one leaves its neighbours


@pytest.mark.skipif(not THP_SETTING.exists(),
                    reason="this kernel has no transparent huge pages (madvise(MADV_HUGEPAGE) is Linux's)")
def test_the_arena_is_marked_for_huge_pages():
    memory = huge_pages.arena(8 * huge_pages.HUGE_PAGE + 5)
    assert memory.numel() == 8 * huge_pages.HUGE_PAGE + 5 and not memory.any()
    flags = _vma_flags(memory.data_ptr())
    assert "hg" in flags  # the kernel recorded MADV_HUGEPAGE on the mapping
    assert "sh" not in flags  # private: a shared anonymous mapping's huge pages follow shmem_enabled


def test_the_engine_keeps_its_kv_cache_and_packed_weights_in_arenas(make_engine):
    runner = make_engine(num_blocks=64).runner
    if runner.device.type != "cpu":
        pytest.skip("the KV cache and weights are on the GPU")
    caches = [t for pair in runner.kv_caches for t in pair]
    assert caches[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert all(b.data_ptr() > a.data_ptr() for a, b in zip(caches, caches[1:]))  # one arena, in order
    owned = [lin.own for lin in runner.fast.linears() if lin.own is not None] if runner.fast else []
    if owned:  # the kernels' GEMM took the weights
        assert owned[0].data_ptr() % huge_pages.HUGE_PAGE == 0
        assert all(b.data_ptr() > a.data_ptr() for a, b in zip(owned, owned[1:]))
