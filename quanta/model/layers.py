"""The parts of a Llama-family decoder block: RMSNorm, GQA attention over the paged KV cache,
the SwiGLU MLP. :mod:`quanta.model.llama` stacks them into blocks and the model;
:mod:`quanta.model.gemma` builds Gemma 3's blocks on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quanta.model.attention import AttentionBatch, attend
from quanta.model.config import ModelConfig
from quanta.model.linear import PackedLinear
from quanta.model.rope import apply_rotary


class RMSNorm(nn.Module):
    """RMSNorm (``torch.nn.functional.rms_norm``, which accumulates bf16 in float32).

    The HF reference rounds to the model dtype before the weight multiply; this
    rounds once after it, so bf16 outputs may differ by one ulp.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.shape = (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape, self.weight, self.eps)


class Attention(nn.Module):
    """GQA self-attention with fused q/k/v projection."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = PackedLinear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.o_proj = PackedLinear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # OLMoE: RMSNorm over the whole q / k projection, and optional clamping.
        self.full_qk_norm = cfg.qk_norm_full
        if self.full_qk_norm:
            self.q_norm, self.k_norm = RMSNorm(q_size, cfg.rms_norm_eps), RMSNorm(kv_size, cfg.rms_norm_eps)
        self.clip_qkv = cfg.clip_qkv
        #: the sliding window of this layer in positions, 0 for none (:func:`~quanta.model.attention.attend`)
        self.window = cfg.window_of(layer_idx)

    def forward(self, x: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x, batch.decode)
        if self.full_qk_norm:
            qkv = self._olmoe_norms(qkv)
        qk = qkv[:, :self.split[0] + self.split[1]].view(t, h + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.split[0] + self.split[1]:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.full_qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])], dim=1)
        qk = apply_rotary(qk, *self.rope_tables(batch))  # q and k heads rotated together
        out = attend(qk[:, :h], qk[:, h:], v, self.layer_idx, batch, self.window)
        return self.o_proj(out.reshape(t, -1), batch.decode)

    def rope_tables(self, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables this layer rotates with: the batch's local ones for a sliding
        layer where the model has them (Gemma 3), else the global ones."""
        local = batch.local_rope_tables
        return local if self.window and local is not None else batch.rope_tables

    def _olmoe_norms(self, qkv: torch.Tensor) -> torch.Tensor:
        """``[T, q+2kv]`` -> same with q and k RMS-normed over their full width, then clamped."""
        q, k, v = qkv.split(self.split, dim=-1)
        qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        return qkv.clamp_(-self.clip_qkv, self.clip_qkv) if self.clip_qkv is not None else qkv


class MLP(nn.Module):
    """SwiGLU MLP with fused gate/up projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = PackedLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = PackedLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, decode: bool = False) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, decode).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up), decode)  # in place: one [rows, I] buffer, not two
