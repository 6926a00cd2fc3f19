"""Decode steps of a dense Llama-family model with the glue between matmuls in C.

A step whose sequences all decode (one new token each) runs, per layer, four
matmuls through the model's own linears (int4 / int8 / fp16 forms or the
packed reference, chosen by row count as on the PyTorch path) and three C
calls from :mod:`quanta.model.native`: residual add + RMSNorm, RoPE + KV
cache write + attention, SwiGLU. The residual stream stays float32 between
layers; matmul inputs and outputs are in the model dtype. The KV cache is
the same :class:`~quanta.model.attention.KVCache` the PyTorch path reads, so
steps of either path may follow each other.

Numerics differ from the PyTorch path (which rounds to bf16 between ops) by
about a bf16 ulp per op; ``tests/test_native_decode.py`` bounds the logit
difference and checks greedy agreement.
"""

from __future__ import annotations

import ctypes

import torch

from quanta.model import native
from quanta.model.attention import AttentionBatch
from quanta.model.config import ModelConfig


def unsupported_reason(cfg: ModelConfig, dtype: torch.dtype) -> str | None:
    """Why the C decode path cannot run this model (None: it can)."""
    if dtype not in (torch.bfloat16, torch.float32):
        return f"dtype {dtype}"
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        return "MoE layers"
    if cfg.qk_norm or cfg.qk_norm_full or cfg.clip_qkv is not None:
        return "q/k norms"
    if cfg.head_dim % 2 or cfg.num_attention_heads % cfg.num_key_value_heads:
        return "head layout"
    return None


class NativeDecoder:
    """Runs all-decode steps of ``model`` (a :class:`~quanta.model.llama.LlamaModel`).

    Raises:
        ValueError: the model is not supported (see :func:`unsupported_reason`).
        native.NativeUnavailable: the C library cannot be built here.
    """

    def __init__(self, model) -> None:
        cfg = model.config
        dtype = model.embed_tokens.weight.dtype
        reason = unsupported_reason(cfg, dtype)
        if reason:
            raise ValueError(f"native decode does not support {reason}")
        self.lib = native.load()
        self.model, self.cfg, self.dtype = model, cfg, dtype
        self.io_bf16 = int(dtype == torch.bfloat16)
        self.eps = ctypes.c_float(cfg.rms_norm_eps)
        f32 = lambda t: t.detach().float().contiguous()  # noqa: E731
        self.norms = [(f32(layer.input_layernorm.weight), f32(layer.post_attention_layernorm.weight)) for layer in model.layers]
        self.final_norm = f32(model.norm.weight)
        self.inv_freq = model.rope.inv_freq.float().contiguous()
        self._scratch: torch.Tensor | None = None

    def scratch(self, max_len: int) -> torch.Tensor:
        """float32 work space big enough for every C call at ``max_len`` cache positions."""
        c = self.cfg
        width = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        group = c.num_attention_heads // c.num_key_value_heads
        need = max(width + (group + 2) * c.head_dim + group * max_len, 2 * c.intermediate_size, c.hidden_size)
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        return self._scratch

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """``[T]`` token ids, one per decoding sequence -> ``[T, hidden]`` final-normed hidden states (model dtype)."""
        c, lib, io = self.cfg, self.lib, self.io_bf16
        rows, heads, kv_heads, dim = input_ids.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        kv = batch.kv
        scratch = self.scratch(kv.max_len).data_ptr()
        x = self.model.embed_tokens(input_ids).float().contiguous()
        h = torch.empty(rows, c.hidden_size, dtype=self.dtype)
        attn = torch.empty(rows, heads * dim, dtype=self.dtype)
        mid = torch.empty(rows, c.intermediate_size, dtype=self.dtype)
        xp, hp, ap, mp = x.data_ptr(), h.data_ptr(), attn.data_ptr(), mid.data_ptr()
        slots, positions = batch.write_slots.data_ptr(), batch.positions.data_ptr()
        cache_bf16 = int(kv.k[0].dtype == torch.bfloat16)
        slot_stride, head_stride = kv.k[0].stride(0), kv.k[0].stride(1)
        down = None
        for i, layer in enumerate(self.model.layers):
            norm_in, norm_post = self.norms[i]
            lib.residual_rms_norm(rows, c.hidden_size, xp, _ptr(down), norm_in.data_ptr(), self.eps, hp, io, scratch)
            qkv = _checked(layer.self_attn.qkv_proj(h), self.dtype)
            lib.attention_decode(rows, qkv.data_ptr(), io, heads, kv_heads, dim, self.inv_freq.data_ptr(), slots, positions,
                                 kv.k[i].data_ptr(), kv.v[i].data_ptr(), cache_bf16, slot_stride, head_stride, ap, scratch)
            o = _checked(layer.self_attn.o_proj(attn), self.dtype)
            lib.residual_rms_norm(rows, c.hidden_size, xp, o.data_ptr(), norm_post.data_ptr(), self.eps, hp, io, scratch)
            gate_up = _checked(layer.mlp.gate_up_proj(h), self.dtype)
            lib.silu_mul(rows, c.intermediate_size, gate_up.data_ptr(), io, mp, scratch)
            down = _checked(layer.mlp.down_proj(mid), self.dtype)
        out = torch.empty(rows, c.hidden_size, dtype=self.dtype)
        lib.residual_rms_norm(rows, c.hidden_size, xp, _ptr(down), self.final_norm.data_ptr(), self.eps,
                              out.data_ptr(), io, scratch)
        return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _checked(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A matmul output as the C code reads it: contiguous, in the model dtype."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()
