"""A lean forward for plain llama-family models (llama, mistral without sliding window).

The same weights and the same maths as transformers' LlamaForCausalLM, with the per-step
framework cost cut: q/k/v and gate/up projections fused into one matmul each (the original
Linear weights become views of the fused ones, so memory is not doubled and the transformers
path keeps working), rotary tables computed once per step, no per-layer wrappers or kwargs
plumbing, and the LM head applied only to the rows that sample. On the CPU the matmuls run
through oneDNN with each weight packed once at start (`PackedLinear`, residual adds fused into
the output projections), at the price of a packed copy of the weights: 1.2-2x faster than the
default BLAS call from a few rows on. At one or two rows some CPUs' BLAS is faster (fp32 with
MKL on a Sapphire Rapids box: 25 vs 39 us for q/k/v at one row, a single chat decoding about
13 % faster); the forward times both on one of the model's own weights when it is built and
runs that many rows unpacked where BLAS wins by PLAIN_MARGIN (`plain_rows`). With the C kernels
(cpu_kernels) the norms, the rotary embedding and the gated activation take one pass each, and
in float32 and bfloat16 (on AMX tiles where the CPU has those, by `vdpbf16ps` where it has
AVX512-BF16, widened to float32 in registers elsewhere) each weight gets a second packed copy
for the kernels' own GEMM, which the forward times against oneDNN's once a process, on every
layer's projections streamed as a step streams them, and uses up to the most rows where it won
within OWN_MARGIN (`own_rows`: 64-256 on an AMD EPYC with AVX2, where it runs a decode step's
matmuls 1.2-1.6x faster; in fp32 128 on an Intel Xeon with
AVX-512, 1.3-1.5x at 16-64 rows, where one hot weight timed alone had made it a coin toss from 16
rows on; in bf16 1 there while oneDNN's AMX matmul was far ahead from 16 rows, 512 on such a
Xeon once the own GEMM ran on AMX tiles too; in bf16 512 on an AMD EPYC Zen 5). Where every
matmul of a step takes the own GEMM and the attention kernel takes every row, the layers run in
one C call (`decoder_layers`: the same kernels in the same order, the same logits to the bit,
without the Python between them).
Anything else (qwen2 with biases, scaled rope, other activations, ...) goes through
transformers' own classes; a test checks this forward's logits against transformers'.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from appliance.numeric import best_times

from . import huge_pages
from .cpu_kernels import CpuKernels, LayerShape
from .paged_attention import AttentionMetadata, kernel_scale, paged_attention

log = logging.getLogger(__name__)

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM")
# torch's private oneDNN ops behind PackedLinear (no public API packs a linear weight). pyproject.toml
# pins the torch range tested; tests/test_library_internals.py fails, naming the version, when they move.
PACKED_OPS = ("_reorder_linear_weight", "_linear_pointwise")


@functools.cache
def packing_available(dtype: torch.dtype) -> bool:
    """oneDNN weight packing works for `dtype` in this torch on this CPU (else PackedLinear runs
    plain F.linear): the ops exist, and packing a small weight succeeds (bfloat16 needs AVX512-BW
    or AVX-NE-CONVERT)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    missing = [op for op in PACKED_OPS if not hasattr(torch.ops.mkldnn, op)]
    if missing:
        log.warning("torch %s has no torch.ops.mkldnn.%s: the lean forward's matmuls run unpacked (slower)",
                    torch.__version__, ", ".join(missing))
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), PackedLinear.BATCH_HINT)
    except RuntimeError as exc:
        log.warning("oneDNN cannot pack %s weights here (torch %s: %s): the lean forward's matmuls run unpacked",
                    dtype, torch.__version__, str(exc).splitlines()[0])
        return False
    return True


def supports(model: torch.nn.Module) -> bool:
    cfg = model.config
    rope = getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    return (
        type(model).__name__ in SUPPORTED
        and not getattr(cfg, "attention_bias", False)
        and not getattr(cfg, "mlp_bias", False)
        and getattr(cfg, "hidden_act", "silu") == "silu"
        and getattr(cfg, "sliding_window", None) is None
        and rope_type == "default"
    )


class PackedLinear:
    """y = x @ W.T (+ residual) on the CPU through packed copies of W: the C kernels' own GEMM
    (where it takes W) up to `own_rows` rows, oneDNN's packed matmul beyond; plain F.linear elsewhere, for
    at most `plain_rows` rows, and where nothing is packed."""

    BATCH_HINT = 64  # oneDNN picks the packed layout for about this many rows; any count works

    def __init__(self, weight: torch.Tensor, plain_rows: int = 0, kernels: CpuKernels | None = None):
        self.weight = weight
        self.plain_rows = plain_rows
        self.packed = None
        if weight.device.type == "cpu" and packing_available(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.BATCH_HINT)
        self.kernels = kernels if kernels is not None and kernels.supports_gemm(weight) else None
        self.own = self.kernels.pack_gemm(weight) if self.kernels else None
        self.own_rows = 0

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] <= self.plain_rows:
            return self._plain(x, residual)
        return self.packed_matmul(x, residual)

    def packed_matmul(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ residual) through the packed path x's row count takes (the own GEMM up to
        `own_rows`, oneDNN's beyond), whatever `plain_rows` says; F.linear where nothing is packed."""
        if x.shape[0] <= self.own_rows:
            return self.kernels.gemm(x, self.own, self.weight.shape[0], residual)
        if self.packed is None:
            return self._plain(x, residual)
        if residual is None:
            return self.onednn_matmul(x)
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, None, "add")

    def _plain(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return y if residual is None else residual + y

    def onednn_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T through oneDNN's packed weight, whatever the row count."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


OWN_ROWS_TRIED = (1, 4, 8, 16, 32, 64, 128, 256, 512)
# The own GEMM is kept while its matmuls take at most this multiple of the replaced call's time: it
# also lets a step's layers run as one C call (decoder_layers), which the matmuls' timing does not
# see (fp32 on an AMD EPYC Zen 5: own and oneDNN even at 512 rows, and skewed-64's run 1.03x faster
# with the 512-row prefill chunks in one call than through the Python loop and oneDNN). A loss is
# timed twice (at 512 rows one timing of a fresh server lost by more than the margin where six
# fresh processes' timings had the own GEMM 1-8 % ahead), and a count lost twice is timed again
# once the next count has won: of three servers started at once on one 2-core box, loading side
# by side, one lost 4 rows twice and kept oneDNN and the Python layer loop from 2 rows on for its
# whole life (skewed-48 served at 364-436 tok/s against 416-534 by its two neighbours, which timed
# 512). The margin also reaches the matmuls outside the one call (the LM head, steps the Python
# loop runs): at most 5 %.
OWN_MARGIN = 1.05


def faster_own_rows(linears: Sequence[PackedLinear],
                    timed: Callable[[Sequence[Callable[[], object]]], list[float]] | None = None) -> int:
    """The most rows (of OWN_ROWS_TRIED, counting up) at which the C kernels' GEMM took at most
    OWN_MARGIN times the call it replaces (oneDNN's packed matmul, or F.linear where nothing is
    packed), in its timing or, after a loss, in a second one, over one pass of `linears` (every
    layer's projections, in a step's order: each weight streamed from memory as a step streams it,
    where one weight timed again and again sits in cache and tells a different story; each with the
    kernels' packed copy), `timed` now in this thread. The count stops at two lost counts in a row,
    or at a lost count that loses again when timed after the next count won; one that wins then was
    a slow spell of the machine (other processes loading beside this one), not the own GEMM's."""
    timed = timed or functools.partial(best_times, repeats=3, calls=1)  # 512 rows: 0.05-0.25 s a pass
    others = [linear.onednn_matmul if linear.packed is not None else functools.partial(F.linear, weight=linear.weight)
              for linear in linears]

    def won(rows: int) -> bool:
        inputs = {width: torch.randn(rows, width, dtype=linears[0].weight.dtype)  # one per input width, as in a step
                  for width in {linear.weight.shape[1] for linear in linears}}
        xs = [inputs[linear.weight.shape[1]] for linear in linears]
        calls = [lambda: [lin.kernels.gemm(x, lin.own, lin.weight.shape[0]) for x, lin in zip(xs, linears)],
                 lambda: [other(x) for x, other in zip(xs, others)]]
        return any(own <= OWN_MARGIN * replaced for own, replaced in (timed(calls) for _ in range(2)))

    rows_won, lost = 0, None  # lost: the count lost since the last won one
    with torch.inference_mode():
        for rows in OWN_ROWS_TRIED:
            if not won(rows):
                if lost is not None:
                    break
                lost = rows
            elif lost is not None and not won(lost):
                break
            else:
                rows_won, lost = rows, None
    return rows_won


_OWN_ROWS: dict[tuple, int] = {}  # faster_own_rows per shapes, dtype, threads and AMX state: timed once a process


def own_rows_on_this_cpu(linears: Sequence[PackedLinear]) -> int:
    """faster_own_rows(linears), timed at the first call in this process for their shapes, dtype,
    thread count and the AMX path's state, and the same answer after: every engine built in one
    process splits its matmuls alike, and none pays the timing again. 0 where any lacks the
    kernels' packed copy."""
    if not linears or any(linear.own is None for linear in linears):
        return 0
    key = (tuple(tuple(linear.weight.shape) for linear in linears), linears[0].weight.dtype, torch.get_num_threads(),
           linears[0].kernels.amx)
    if key not in _OWN_ROWS:
        _OWN_ROWS[key] = faster_own_rows(linears)
    return _OWN_ROWS[key]


PLAIN_MARGIN = 0.85  # BLAS must take at most this share of the packed call's time to be used
PLAIN_ROWS_TRIED = (1, 2)


def faster_plain_rows(linear: PackedLinear, timed: Callable[[Sequence[Callable[[], object]]], list[float]] = best_times) -> int:
    """The most rows (of PLAIN_ROWS_TRIED, counting up while BLAS keeps winning) at which plain
    F.linear took at most PLAIN_MARGIN of the packed call's time (own GEMM or oneDNN's, as the
    rows choose) on `linear`'s weight, `timed` now in this thread; 0 when the weight is not packed.
    Call it after setting `own_rows`."""
    if linear.packed is None and linear.own_rows == 0:
        return 0
    rows_won = 0
    with torch.inference_mode():
        for rows in PLAIN_ROWS_TRIED:
            x = torch.randn(rows, linear.weight.shape[1], dtype=linear.weight.dtype)
            plain, packed = timed([lambda: F.linear(x, linear.weight), lambda: linear.packed_matmul(x)])
            if plain > PLAIN_MARGIN * packed:
                break
            rows_won = rows
    return rows_won


def own_copies_on_huge_pages(linears: Sequence[PackedLinear]) -> list[PackedLinear]:
    """Move the own GEMM's packed copies of `linears` into one arena on 2 MB pages (see
    huge_pages), one at a time (each old copy is freed as the next moves); returns the linears
    that have one (the kernels decline some weights)."""
    owned = [linear for linear in linears if linear.own is not None]
    if owned:
        places = huge_pages.zeros([linear.own.shape for linear in owned], owned[0].own.dtype, fault_in=False)
        for linear, place in zip(owned, places):
            linear.own = place.copy_(linear.own)
    return owned


def _fuse(linears: list[torch.nn.Linear]) -> torch.Tensor:
    """Concatenate Linear weights and re-point each Linear at its slice of the fused tensor."""
    fused = torch.cat([lin.weight.data for lin in linears]).contiguous()
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[row : row + n], requires_grad=False)
        row += n
    return fused


class _Layer:
    def __init__(self, layer: torch.nn.Module, kernels: CpuKernels | None):
        attn, mlp = layer.self_attn, layer.mlp
        self.idx = attn.layer_idx
        self.scaling = attn.scaling
        self.ln1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.ln2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.qkv = PackedLinear(_fuse([attn.q_proj, attn.k_proj, attn.v_proj]), kernels=kernels)
        self.split = (attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0])
        self.o = PackedLinear(attn.o_proj.weight, kernels=kernels)
        self.gate_up = PackedLinear(_fuse([mlp.gate_proj, mlp.up_proj]), kernels=kernels)
        self.down = PackedLinear(mlp.down_proj.weight, kernels=kernels)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (fp32 statistics)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class FastLlamaForward:
    """Callable like the runner's model call: (ids [T], positions [T], meta, keep rows) -> logits."""

    def __init__(self, model: torch.nn.Module, kernels: CpuKernels | None = None):
        cfg = model.config
        self.model = model
        self.inner = model.model
        self.layers = [_Layer(layer, kernels) for layer in self.inner.layers[: cfg.num_hidden_layers]]
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.lm_head = PackedLinear(model.lm_head.weight, kernels=kernels)
        self.kernels = kernels  # the runner passes them only for a dtype and device they support
        owned = own_copies_on_huge_pages(self.linears())  # the copies a decode step streams
        self.own_rows = own_rows_on_this_cpu(self.linears()[:-1])  # the layers' projections: a step's GEMMs
        for linear in owned:
            linear.own_rows = self.own_rows
        self.plain_rows = faster_plain_rows(self.layers[0].gate_up) if self.layers else 0
        for linear in self.linears():
            linear.plain_rows = self.plain_rows
        if self.own_rows:
            log.info("matmuls of at most %d rows run through the C kernels' GEMM (the last row count where it took "
                     "at most %.2fx oneDNN's time on this CPU)", self.own_rows, OWN_MARGIN)
        if self.plain_rows:
            log.info("matmuls of at most %d row(s) run unpacked (BLAS beat the packed call on this CPU)",
                     self.plain_rows)
        self.layer_shape = LayerShape(self.num_heads, self.num_kv_heads, self.head_dim, cfg.intermediate_size)
        self.layer_eps = torch.tensor([[layer.eps1, layer.eps2] for layer in self.layers], dtype=torch.float32)
        # the addresses decoder_layers reads, per layer: tensors that live as long as this forward (the
        # norms' weights, the own copies, moved once above) and the runner's KV caches (made once)
        self._layer_table: tuple[list, torch.Tensor] | None = None  # (the KV caches, the table)
        self._work = torch.empty(0, dtype=model.dtype)  # decoder_layers' scratch, grown as steps need
        qkv_split = (self.num_heads * self.head_dim, *(2 * [self.num_kv_heads * self.head_dim]))
        self.fuse_layers = (bool(self.layers) and len({layer.scaling for layer in self.layers}) == 1
                            and all(linear.own is not None for linear in self.linears()[:-1])
                            and all(layer.split == qkv_split and layer.gate_up.weight.shape[0] == 2 * cfg.intermediate_size
                                    for layer in self.layers))

    def _runs_in_one_call(self, rows: int, meta: AttentionMetadata) -> bool:
        """Whether this step's layers run as one `decoder_layers` call: every row attended by the
        kernel, every matmul by the own GEMM (the calls the Python loop would make, in one)."""
        by_kernel = meta.kernel_rows
        return (self.fuse_layers and self.plain_rows < rows <= self.own_rows and by_kernel is not None
                and by_kernel.rows == rows and not meta.decode_groups and not meta.prefills)

    def _layers_in_one_call(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> None:
        if self._layer_table is None or self._layer_table[0] is not meta.kv_caches:
            table = [[layer.ln1.data_ptr(), layer.ln2.data_ptr(), layer.qkv.own.data_ptr(), layer.o.own.data_ptr(),
                      layer.gate_up.own.data_ptr(), layer.down.own.data_ptr(),
                      *(cache.data_ptr() for cache in meta.kv_caches[layer.idx])] for layer in self.layers]
            self._layer_table = meta.kv_caches, torch.tensor(table, dtype=torch.int64)
        need = self.layer_shape.work_size(*h.shape)
        if self._work.numel() < need:
            self._work = h.new_empty(need)
        by_kernel, (k_cache, _) = meta.kernel_rows, meta.kv_caches[0]
        self.kernels.decoder_layers(h, self._layer_table[1], self.layer_eps, self.layer_shape, cos, sin, meta.slot_mapping,
                                    by_kernel.block_tables, by_kernel.ctx_lens, by_kernel.decode_rows, meta.block_size,
                                    k_cache.shape[1], kernel_scale(self.layers[0].scaling, self.head_dim), self._work)

    def linears(self) -> list[PackedLinear]:
        """Every matmul of the forward (the layers' projections and the LM head)."""
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x, weight, eps) if self.kernels else _rms_norm(x, weight, eps)

    def _qkv(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Project, rotate q and k; q [T, H, D], k/v [T, KVH, D] (views of one buffer with the kernels)."""
        total, hd = x.shape[0], self.head_dim
        qkv = layer.qkv(x)
        if self.kernels:  # q's and k's heads are adjacent in the fused output: one pass rotates both
            self.kernels.rotary_(qkv, self.num_heads + self.num_kv_heads, hd, cos, sin)
            q, k, v = qkv.split(layer.split, dim=-1)
            return q.view(total, self.num_heads, hd), k.view(total, self.num_kv_heads, hd), v.view(total, self.num_kv_heads, hd)
        q, k, v = qkv.split(layer.split, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
        q = _rotate(q.view(total, self.num_heads, hd), cos, sin)
        k = _rotate(k.view(total, self.num_kv_heads, hd), cos, sin)
        return q, k, v.view(total, self.num_kv_heads, hd)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            return self.kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, keep: torch.Tensor) -> torch.Tensor:
        h = self.inner.embed_tokens(ids)  # [T, hidden]
        cos, sin = self.inner.rotary_emb(h.unsqueeze(0), positions.unsqueeze(0))
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [T, D]
        total = ids.shape[0]
        if self._runs_in_one_call(total, meta):
            self._layers_in_one_call(h, cos, sin, meta)
        else:
            for layer in self.layers:
                q, k, v = self._qkv(layer, self._norm(h, layer.ln1, layer.eps1), cos, sin)
                attn = paged_attention(layer.idx, q, k, v, meta, layer.scaling)
                h = layer.o(attn.view(total, -1), residual=h)
                h = layer.down(self._act(layer.gate_up(self._norm(h, layer.ln2, layer.eps2))), residual=h)
        norm = self.inner.norm
        return self.lm_head(self._norm(h[keep], norm.weight, norm.variance_epsilon))
