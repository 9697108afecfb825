"""The engine's C kernels for the CPU (csrc/*.c): built with the system C compiler at first use,
cached per source, flags and CPU, loaded with ctypes.

- `paged_attend` attends rows (decode rows, and a prefill chunk's rows: each a query over its
  sequence's slots up to itself), reading their keys and values block by block straight from the
  paged cache, where the SDPA path first copies them into a dense tensor (moving every cached
  byte twice more); in bfloat16 with AVX512-BF16 a prefill chunk's rows share its context copied
  once into tiles.
- `rms_norm`, `rotary_`, `silu_mul` do the llama layer's elementwise work in one pass each,
  where torch runs five to eight kernels.
- `argmax_rows` picks greedy rows' tokens from the logits.
- `gemm` (csrc/packed_gemm.c) multiplies float32 or bfloat16 rows (bfloat16 by `vdpbf16ps` where
  the CPU has AVX512-BF16, on AMX tiles where it has those too, else widened to float32 in
  registers) by a weight packed once for it (`pack_gemm`): at a decode step's row counts it beats
  oneDNN's packed matmul, on some CPUs up to a 512-row prefill chunk (the lean forward times the
  two and uses it where it wins).
- `decoder_layers` (csrc/decoder_layers.c) runs every decoder layer of a step through the kernels
  above in one call and one OpenMP parallel region, where the lean forward calls them one by one
  from Python.

Optional: without a compiler, or if the build fails, `load()` returns None and the engine keeps
its torch paths (same results up to float rounding; both are tested).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model_loader import cache_root

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / name for name in ("cpu_kernels.c", "packed_gemm.c", "decoder_layers.c")]
# -ffast-math at compile time only: linked with it, gcc adds crtfastmath.o, whose constructor
# turns on flush-to-zero for the whole process (subnormal floats silently become 0 everywhere).
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp"]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# each kernel's arguments and result, built as NAME_f32 and NAME_bf16
_SIGNATURES = {
    "paged_attend": ([_P, _I, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _I, _F, _P, _I], None),
    "rms_norm": ([_P, _P, _F, _I, _I, _P, _I], None),
    "rotary": ([_P, _I, _I, _I, _I, _P, _P, _I], None),
    "silu_mul": ([_P, _I, _I, _P, _I], None),
    "argmax_rows": ([_P, _I, _I, _I, _P, _I], None),
    "gemm": ([_P, _I, _I, _I, _P, _I, _P, _P, _I], None),
    "decoder_layers": ([_P, _I, _I, _I, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _P, _I, _I, _I, _F, _P, _I],
                       ctypes.c_int),
}
_state: dict[str, CpuKernels | None] = {}


@dataclass(frozen=True)
class LayerShape:
    """A decoder layer's sizes, as `decoder_layers` takes them."""

    heads: int
    kv_heads: int
    head_dim: int
    inter: int  # the MLP's intermediate size

    def work_size(self, rows: int, hidden: int) -> int:
        """Values of scratch `decoder_layers` needs for `rows` rows (csrc/decoder_layers.c's `work`)."""
        return rows * (2 * hidden + (2 * self.heads + 2 * self.kv_heads) * self.head_dim + 3 * self.inter)


class CpuKernels:
    """Typed entry points into the built library (float32 and bfloat16 CPU tensors)."""

    def __init__(self, lib: ctypes.CDLL):
        self.max_group = lib.paged_attend_max_group()
        self.max_dim = lib.paged_attend_max_dim()
        self.dim_multiple = lib.paged_attend_dim_multiple()
        self.panel_width = lib.gemm_panel_width()
        self.layer_pointers = lib.decoder_layer_pointers()
        self._lib = lib
        lib.gemm_amx.argtypes, lib.gemm_amx.restype = [ctypes.c_int], ctypes.c_int
        self.amx = bool(lib.gemm_amx(1))
        self._fns: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for name, (argtypes, restype) in _SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, restype
                self._fns[name, dtype] = fn

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in _SUFFIX

    def supports_attention(self, dtype: torch.dtype, device: torch.device, num_heads: int, kv_heads: int,
                           head_dim: int) -> bool:
        return (self.supports(dtype, device) and num_heads % kv_heads == 0
                and num_heads // kv_heads <= self.max_group and head_dim <= self.max_dim
                and head_dim % self.dim_multiple == 0)

    def use_amx(self, on: bool) -> bool:
        """Turn the bfloat16 GEMM's AMX path on or off (on by default where built and Linux grants
        the tiles; the other path is the AVX512-BF16 one); whether it is on now."""
        self.amx = bool(self._lib.gemm_amx(int(on)))
        return self.amx

    def supports_gemm(self, weight: torch.Tensor) -> bool:
        """Whether `gemm` takes this weight: float32, or bfloat16 with an even k."""
        return (weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in _SUFFIX
                and (weight.dtype == torch.float32 or weight.shape[1] % 2 == 0))

    def pack_gemm(self, weight: torch.Tensor) -> torch.Tensor:
        """A packed copy of W [n, k] for `gemm`: panels of `panel_width` output columns, each
        k-major (float32: W[p * width + j, kk] at [p, kk, j]; bfloat16 in k pairs: W[p * width + j,
        2 q + e] at [p, q, j, e]), zero rows padding n to whole panels."""
        n, k = weight.shape
        pad = -n % self.panel_width
        padded = F.pad(weight.detach(), (0, 0, 0, pad))
        if weight.dtype == torch.bfloat16:
            return padded.view(-1, self.panel_width, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        return padded.view(-1, self.panel_width, k).transpose(1, 2).contiguous()

    def gemm(self, x: torch.Tensor, packed: torch.Tensor, n: int, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, k] @ W.T (+ residual [m, n]) for the W [n, k] that `packed` holds (in W's dtype; x's
        rows may be strided)."""
        assert packed.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
        if x.stride(1) != 1:
            x = x.contiguous()
        if residual is not None:
            residual = residual.contiguous()
        out = x.new_empty(x.shape[0], n)
        self._fns["gemm", x.dtype](x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), packed.data_ptr(), n,
                                   None if residual is None else residual.data_ptr(), out.data_ptr(),
                                   torch.get_num_threads())
        return out

    def paged_attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     ctx_lens: torch.Tensor, block_size: int, scale: float, out: torch.Tensor,
                     cold_rows: int | None = None) -> None:
        """out[i] = softmax(q[i] . K_i^T * scale) V_i, K_i/V_i the first ctx_lens[i] slots read
        through row i's block table; the first `cold_rows` rows (all by default: decode rows, each
        its own context) are prefetched ahead, the rest (a prefill chunk's rows, sharing one
        context that stays in cache) are not.

        q [rows, H, D] (any row/head strides, D contiguous), out [rows, H, D], caches [KVH, slots, D],
        block_tables [rows, width] and ctx_lens [rows] int64."""
        rows, num_heads, head_dim = q.shape
        kv_heads, slots, _ = k_cache.shape
        assert q.stride(2) == 1 and all(t.is_contiguous() for t in (k_cache, v_cache, block_tables, ctx_lens, out))
        assert block_tables.dtype == ctx_lens.dtype == torch.int64 and out.dtype == q.dtype == k_cache.dtype
        self._fns["paged_attend", q.dtype](
            q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], ctx_lens.data_ptr(), rows, rows if cold_rows is None else cold_rows, num_heads,
            kv_heads, head_dim, block_size, slots,
            scale, out.data_ptr(), torch.get_num_threads())

    def decoder_layers(self, h: torch.Tensor, layers: torch.Tensor, eps: torch.Tensor, shape: LayerShape,
                       cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                       ctx_lens: torch.Tensor, cold_rows: int, block_size: int, num_slots: int, scale: float,
                       work: torch.Tensor) -> None:
        """Every decoder layer over h [rows, hidden] (in place), each as the lean forward runs it
        with these kernels (csrc/decoder_layers.c): the whole attention by `paged_attend` (every
        row), every matmul by `gemm`. `layers` [num_layers, layer_pointers] int64 holds each
        layer's addresses (its norms' weights, the packed copies of its q/k/v, o, gate/up and down
        weights, its K and V caches: the order of csrc/decoder_layers.c's enum), `eps` [num_layers,
        2] float32 its norms' epsilons; cos/sin [rows, head_dim], slot_mapping [rows], block_tables
        and ctx_lens as `paged_attend` takes them; `work` scratch of at least `shape.work_size(rows,
        hidden)` values in h's dtype. MemoryError, h untouched, where the step's small attention
        plan cannot be allocated."""
        rows, hidden = h.shape
        assert h.dtype in _SUFFIX and layers.shape[1] == self.layer_pointers and eps.shape == (layers.shape[0], 2)
        assert all(t.is_contiguous() for t in (h, layers, eps, cos, sin, slot_mapping, block_tables, ctx_lens, work))
        assert layers.dtype == slot_mapping.dtype == block_tables.dtype == ctx_lens.dtype == torch.int64
        assert eps.dtype == torch.float32 and work.dtype == h.dtype and work.numel() >= shape.work_size(rows, hidden)
        assert slot_mapping.shape == ctx_lens.shape == (rows,) and block_tables.shape[0] == rows
        assert cos.shape == sin.shape == (rows, shape.head_dim)
        failed = self._fns["decoder_layers", h.dtype](
            h.data_ptr(), rows, hidden, layers.shape[0], layers.data_ptr(), eps.data_ptr(), shape.heads, shape.kv_heads,
            shape.head_dim, shape.inter, cos.data_ptr(), sin.data_ptr(), slot_mapping.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], ctx_lens.data_ptr(), cold_rows, block_size, num_slots, scale, work.data_ptr(),
            torch.get_num_threads())
        if failed:  # its few bytes of plan could not be allocated; h is untouched
            raise MemoryError("decoder_layers: out of memory for the step's attention plan")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """transformers' LlamaRMSNorm of each row of x [rows, dim]."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self._fns["rms_norm", x.dtype](x.data_ptr(), weight.data_ptr(), eps, x.shape[0], x.shape[1], out.data_ptr(),
                                       torch.get_num_threads())
        return out

    def rotary_(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate, in place, the first `heads` heads of each row of x [rows, >= heads * head_dim]
        (rows may be strided) by cos/sin [rows, head_dim] (contiguous)."""
        assert x.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
        self._fns["rotary", x.dtype](x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                                     torch.get_num_threads())

    def argmax_rows(self, x: torch.Tensor) -> list[int]:
        """Each row's index of its largest value, the first of equal ones, for x [rows, n] (rows may
        be strided): torch's x.max(dim=-1).indices, 10-12x faster on 64 rows of 49152 logits (a
        row with NaN excepted)."""
        assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] > 0
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._fns["argmax_rows", x.dtype](x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                                          torch.get_num_threads())
        return out.tolist()

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [rows, 2 * inter] (gate first, as the fused projection makes it)."""
        assert gate_up.is_contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, inter)
        self._fns["silu_mul", gate_up.dtype](gate_up.data_ptr(), rows, inter, out.data_ptr(),
                                             torch.get_num_threads())
        return out


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
    parts = [*(source.read_text() for source in SOURCES), *COMPILE_FLAGS, *LINK_FLAGS, version, _cpu_signature()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"cpu_kernels-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            objects = [str(Path(work) / source.with_suffix(".o").name) for source in SOURCES]
            for source, obj in zip(SOURCES, objects):
                subprocess.run([compiler, *COMPILE_FLAGS, "-c", str(source), "-o", obj], capture_output=True, text=True, check=True)
            lib = Path(work) / "cpu_kernels.so"
            subprocess.run([compiler, *LINK_FLAGS, *objects, "-o", str(lib), "-lm"], capture_output=True, text=True, check=True)
            os.replace(lib, target)  # atomic: concurrent builders never load a half-written file
        log.info("built the CPU kernels: %s", target)
    return target


def load() -> CpuKernels | None:
    """The kernels, built on the first call (several seconds; cached); None where they cannot be built or loaded."""
    if "kernels" in _state:
        return _state["kernels"]
    kernels = None
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        log.info("no C compiler found: the engine uses its torch paths on the CPU")
    else:
        try:
            kernels = CpuKernels(ctypes.CDLL(str(_build(compiler))))
        except (OSError, subprocess.CalledProcessError, AttributeError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("could not build the CPU kernels (%s): the engine uses its torch paths", detail)
    _state["kernels"] = kernels
    return kernels
