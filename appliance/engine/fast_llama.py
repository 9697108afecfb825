"""A lean forward for plain llama-family models (llama, mistral without sliding window).

The same weights and the same maths as transformers' LlamaForCausalLM, with the per-step
framework cost cut: q/k/v and gate/up projections fused into one matmul each (the original
Linear weights become views of the fused ones, so memory is not doubled and the transformers
path keeps working), rotary tables computed once per step, no per-layer wrappers or kwargs
plumbing, and the LM head applied only to the rows that sample. On the CPU every matmul runs
through oneDNN with its weight packed once at start (`PackedLinear`): faster than the default
BLAS call at every batch size here (1.2-2x, the LM head most), at the price of a packed copy of
the weights. Anything else (qwen2 with biases, scaled rope, other activations, ...) goes through
transformers' own classes; a test checks this forward's logits against transformers'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    """y = x @ W.T, with W packed once for oneDNN on the CPU (plain F.linear elsewhere)."""

    BATCH_HINT = 64  # oneDNN picks the packed layout for about this many rows; any count works

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.packed = None
        if weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.BATCH_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


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

    def __init__(self, model: torch.nn.Module):
        cfg = model.config
        self.model = model
        self.inner = model.model
        self.layers = [_Layer(layer) for layer in self.inner.layers[: cfg.num_hidden_layers]]
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.lm_head = PackedLinear(model.lm_head.weight)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, keep: torch.Tensor) -> torch.Tensor:
        h = self.inner.embed_tokens(ids)  # [T, hidden]
        cos, sin = self.inner.rotary_emb(h.unsqueeze(0), positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, D]
        total, hd = ids.shape[0], self.head_dim
        for layer in self.layers:
            x = _rms_norm(h, layer.ln1, layer.eps1)
            q, k, v = layer.qkv(x).split(layer.split, dim=-1)
            q = _rotate(q.view(total, self.num_heads, hd), cos, sin)
            k = _rotate(k.view(total, self.num_kv_heads, hd), cos, sin)
            attn = paged_attention(layer.idx, q, k, v.view(total, self.num_kv_heads, hd), meta, layer.scaling)
            h = h + layer.o(attn.reshape(total, -1))
            x = _rms_norm(h, layer.ln2, layer.eps2)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return self.lm_head(self.inner.norm(h[keep]))
