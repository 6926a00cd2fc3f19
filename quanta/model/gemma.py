"""Gemma 3's text decoder (1B / 4B / 12B / 27B) on the Llama-family parts, computed as llama.cpp
computes ``gemma3`` GGUFs (``src/models/gemma3.cpp``, the interleaved sliding-window variant).

What differs from a Llama block:

- the embedding is multiplied by ``sqrt(hidden_size)`` (:func:`embedding_scale`);
- four RMSNorms a block: before attention (``input_layernorm``), on the attention's output
  before the residual add (``post_attn_norm``), before the MLP (``post_attention_layernorm``,
  the pre-MLP norm's Llama name) and on the MLP's output (``post_mlp_norm``). Hugging Face's
  ``Gemma3RMSNorm`` multiplies by ``1 + w``; llama.cpp's converter stores ``1 + w``, so these
  are plain RMSNorms over the file's weights;
- per-head q/k RMSNorms (as Qwen3) and a GELU (tanh) gated MLP (:class:`GemmaMLP`);
- attention scores scaled by ``1 / sqrt(query_pre_attn_scalar)``: llama.cpp uses ``head_dim``
  except for the 62-layer 27B model, ``hidden_size / heads`` (:func:`gguf_fields`);
- five of every six layers (:attr:`ModelConfig.sliding_layers`) attend over a sliding window of
  ``sliding_window`` positions and rotate with RoPE base ``rope_local_base_freq`` (10000),
  unscaled; the others attend globally and rotate with ``rope_theta`` and the file's
  ``rope_scaling`` (linear, factor 8, on the 4B and larger);
- the LM head is tied (an ``output.weight`` is used where a file has one); a
  ``final_logit_softcapping`` in the file is applied (Gemma 3's have none).

Paths: projections take the same forms as a Llama's (from the file's blocks where the C library
builds); the sliding layers' prompt rows are attended by SDPA over their windows' blocks, the
global layers' by the C rows kernel; decode steps run in torch (the C decode glue has no Gemma
block), their sliding layers reading only the blocks their windows touch. A sequence keeps every
block of every layer, those behind the windows included.

GGUF names: ``blk.N.post_attention_norm`` -> ``post_attn_norm``, ``blk.N.post_ffw_norm`` ->
``post_mlp_norm``; ``attn_norm`` and ``ffn_norm`` keep the Llama mapping.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quanta.model.attention import AttentionBatch
from quanta.model.config import ModelConfig
from quanta.model.layers import MLP, Attention, RMSNorm
from quanta.model.rope import RotaryEmbedding

#: the architecture name
GEMMA3 = "gemma3"
#: GGUF block tensor stems of Gemma's extra norms -> their module names in a block
GGUF_TENSORS = {"post_attention_norm": "post_attn_norm", "post_ffw_norm": "post_mlp_norm"}
#: layers per sliding-window pattern where a file names none: five local, then one global
DEFAULT_PATTERN = 6
#: RoPE base of the local layers where a file names none
DEFAULT_LOCAL_BASE = 10000.0


class ScaledRMSNorm(RMSNorm):
    """RMSNorm times a constant: Gemma's q norm with the query scale folded in."""

    def __init__(self, dim: int, eps: float, scale: float) -> None:
        super().__init__(dim, eps)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class GemmaAttention(Attention):
    """Llama attention with q/k norms, the layer's window and, where ``query_pre_attn_scalar`` is
    not ``head_dim``, queries scaled so the kernels' ``1 / sqrt(head_dim)`` gives Gemma's scale."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        if scalar != cfg.head_dim:
            self.q_norm = ScaledRMSNorm(cfg.head_dim, cfg.rms_norm_eps, math.sqrt(cfg.head_dim / scalar))


class GemmaMLP(MLP):
    """Gated MLP with GELU (tanh approximation) in place of SiLU."""

    def forward(self, x: torch.Tensor, decode: bool = False) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, decode).split(self.intermediate, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up, decode)


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norms around attention and around the MLP."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(cfg, layer_idx)
        self.post_attn_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_mlp_norm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        x = x + self.post_attn_norm(self.self_attn(self.input_layernorm(x), batch))
        return x + self.post_mlp_norm(self.mlp(self.post_attention_layernorm(x), batch.decode))

    def gguf_norms(self) -> list[tuple[RMSNorm, str]]:
        """Gemma's extra norms with their GGUF stems, for loaders that fill a block by hand."""
        return [(getattr(self, name), stem) for stem, name in GGUF_TENSORS.items()]


def is_gemma(cfg: ModelConfig) -> bool:
    return cfg.architecture == GEMMA3


def embedding_scale(cfg: ModelConfig) -> float | None:
    """What the embedding rows are multiplied by (``sqrt(hidden_size)`` for Gemma), or None."""
    return math.sqrt(cfg.hidden_size) if is_gemma(cfg) else None


def local_rope(cfg: ModelConfig) -> RotaryEmbedding | None:
    """The sliding layers' RoPE where they rotate with their own base (unscaled), else None."""
    if not cfg.sliding_layers or cfg.rope_local_base_freq is None:
        return None
    return RotaryEmbedding(dataclasses.replace(cfg, rope_theta=cfg.rope_local_base_freq, rope_scaling=None))


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)``, or ``logits`` where ``cap`` is None or 0."""
    return logits if not cap else torch.tanh(logits / cap) * cap


def layer_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """HF-style names and shapes of a Gemma block's extra norms (empty for other architectures)."""
    if not is_gemma(cfg):
        return {}
    return {f"model.layers.{layer}.{name}.weight": (cfg.hidden_size,) for name in GGUF_TENSORS.values()}


def sliding_layers(layers: int, pattern: int | list[Any]) -> list[int]:
    """The sliding layers of a ``layers``-block model: llama.cpp's rule for a pattern ``n``
    (layer ``i`` slides when ``i % n < n - 1``; every layer for 0), or a per-layer list of flags."""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"sliding_window_pattern lists {len(pattern)} layers, the model has {layers}")
        return [i for i, slides in enumerate(pattern) if slides]
    return [i for i in range(layers) if pattern == 0 or i % pattern < pattern - 1]


def gguf_fields(field: Callable[[str], Any], layers: int, hidden: int, heads: int) -> dict[str, Any]:
    """:class:`ModelConfig` fields of a ``gemma3`` GGUF from its ``gemma3.*`` keys (``field(key)``
    gives a key's value or None), read as llama.cpp reads them: ``attention.sliding_window``
    (none or 0: every layer global), ``attention.sliding_window_pattern`` (default 6),
    ``rope.freq_base_swa`` (default 10000), ``final_logit_softcapping``; the query scale from the
    layer count (62 layers, the 27B: ``hidden / heads``, else ``head_dim``)."""
    window = int(field("attention.sliding_window") or 0)
    pattern = field("attention.sliding_window_pattern")
    out: dict[str, Any] = {
        "sliding_window": window,
        "sliding_layers": sliding_layers(layers, DEFAULT_PATTERN if pattern is None else pattern) if window else [],
        "rope_local_base_freq": float(field("rope.freq_base_swa") or DEFAULT_LOCAL_BASE) if window else None,
        "final_logit_softcapping": field("final_logit_softcapping") or None,
    }
    if layers == 62:
        out["query_pre_attn_scalar"] = hidden / heads
    return out
