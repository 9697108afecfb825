"""A lean forward for plain llama-family models (llama, mistral without sliding window).

The same weights and the same maths as transformers' LlamaForCausalLM, with the per-step
framework cost cut: q/k/v and gate/up projections fused into one matmul each (the original
Linear weights become views of the fused ones, so memory is not doubled and the transformers
path keeps working), rotary tables computed once per step, no per-layer wrappers or kwargs
plumbing, and the LM head applied only to the rows that sample. On the CPU every matmul runs
through oneDNN with its weight packed once at start (`PackedLinear`, residual adds fused into
the output projections): faster than the default BLAS call at every batch size here (1.2-2x,
the LM head most), at the price of a packed copy of the weights. With the C kernels
(cpu_kernels) the norms, the rotary embedding and the gated activation take one pass each.
Anything else (qwen2 with biases, scaled rope, other activations, ...) goes through
transformers' own classes; a test checks this forward's logits against transformers'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_kernels import CpuKernels
from .paged_attention import AttentionMetadata, paged_attention

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM")


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
    """y = x @ W.T (+ residual), with W packed once for oneDNN on the CPU (plain F.linear elsewhere)."""

    BATCH_HINT = 64  # oneDNN picks the packed layout for about this many rows; any count works

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.packed = None
        if weight.device.type == "cpu" and _onednn_packs(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.BATCH_HINT)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is None:
            y = F.linear(x, self.weight)
            return y if residual is None else residual + y
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, None, "add")


def _onednn_packs(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear runs float32 anywhere, bfloat16 only on CPUs with AVX512-BW/VL/DQ or
    AVX-NE-CONVERT (elsewhere its packing raises; F.linear still runs bf16, emulated)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


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
    def __init__(self, layer: torch.nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.idx = attn.layer_idx
        self.scaling = attn.scaling
        self.ln1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.ln2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.qkv = PackedLinear(_fuse([attn.q_proj, attn.k_proj, attn.v_proj]))
        self.split = (attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0])
        self.o = PackedLinear(attn.o_proj.weight)
        self.gate_up = PackedLinear(_fuse([mlp.gate_proj, mlp.up_proj]))
        self.down = PackedLinear(mlp.down_proj.weight)


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
        self.layers = [_Layer(layer) for layer in self.inner.layers[: cfg.num_hidden_layers]]
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.lm_head = PackedLinear(model.lm_head.weight)
        self.kernels = kernels  # the runner passes them only for a dtype and device they support

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
        for layer in self.layers:
            q, k, v = self._qkv(layer, self._norm(h, layer.ln1, layer.eps1), cos, sin)
            attn = paged_attention(layer.idx, q, k, v, meta, layer.scaling)
            h = layer.o(attn.view(total, -1), residual=h)
            h = layer.down(self._act(layer.gate_up(self._norm(h, layer.ln2, layer.eps2))), residual=h)
        norm = self.inner.norm
        return self.lm_head(self._norm(h[keep], norm.weight, norm.variance_epsilon))
