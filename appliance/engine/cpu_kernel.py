"""The C paged decode-attention kernel (csrc/paged_decode.c): built with the system C compiler at
first use, cached per source, flags and CPU, loaded with ctypes.

It reads each decode row's keys and values block by block straight from the paged cache, where
the SDPA path first copies them into a dense tensor (a gather that moved every cached byte twice
more). Optional: without a compiler, or if the build fails, `load()` returns None and the engine
keeps the SDPA path (same results up to float rounding; both are tested).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..model_loader import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
_FUNCTIONS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_failed = False
_loaded: PagedDecodeKernel | None = None


class PagedDecodeKernel:
    """out[i] = softmax(q[i] . K_i^T * scale) V_i for each decode row i, K_i/V_i read through its block table."""

    def __init__(self, lib: ctypes.CDLL):
        self.max_group = lib.paged_decode_max_group()
        self.max_dim = lib.paged_decode_max_dim()
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fns = {}
        for dtype, name in _FUNCTIONS.items():
            fn = getattr(lib, name)
            fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr]
            fn.restype = None
            self._fns[dtype] = fn

    def supports(self, dtype: torch.dtype, device: torch.device, num_heads: int, kv_heads: int, head_dim: int) -> bool:
        return (
            device.type == "cpu"
            and dtype in self._fns
            and num_heads % kv_heads == 0
            and num_heads // kv_heads <= self.max_group
            and head_dim <= self.max_dim
        )

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, block_size: int, scale: float, out: torch.Tensor) -> None:
        """q/out [rows, H, D], caches [KVH, slots, D], block_tables [rows, width] and ctx_lens [rows] int64."""
        rows, num_heads, head_dim = q.shape
        kv_heads, slots, _ = k_cache.shape
        for t in (q, k_cache, v_cache, block_tables, ctx_lens, out):
            assert t.is_contiguous()
        assert block_tables.dtype == ctx_lens.dtype == torch.int64 and out.dtype == q.dtype == k_cache.dtype
        self._fns[q.dtype](q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                           block_tables.shape[1], ctx_lens.data_ptr(), rows, num_heads, kv_heads, head_dim,
                           block_size, slots, scale, out.data_ptr())


def _cpu_signature() -> str:
    """-march=native binds the build to this CPU: key the cache on its feature flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, _cpu_signature()]).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"paged_decode-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, check=True)
            os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("built the paged decode-attention kernel: %s", target)
    return target


def load() -> PagedDecodeKernel | None:
    """The kernel, built on first call (about a second); None where it cannot be built or loaded."""
    global _loaded, _failed
    if _loaded is not None or _failed:
        return _loaded
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        log.info("no C compiler found: decode attention uses the SDPA path")
        _failed = True
        return None
    try:
        _loaded = PagedDecodeKernel(ctypes.CDLL(str(_build(compiler))))
    except (OSError, subprocess.CalledProcessError, AttributeError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("could not build the paged decode-attention kernel (%s): decode attention uses the SDPA path", detail)
        _failed = True
    return _loaded
