"""Rotary position embedding (rotate-half form, as in HF Llama) with optional scaling."""

from __future__ import annotations

import math

import torch

from quanta.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, scaled per ``cfg.rope_scaling``.

    Supported ``rope_type``: ``default``, ``linear`` (positions divided by
    ``factor``) and ``llama3`` (the band-wise rule of Llama 3.1, as in
    ``transformers.modeling_rope_utils._compute_llama3_parameters``).

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / scaling["factor"]).float()
    if kind == "llama3":
        return _llama3(inv, scaling).float()
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables, indexed by absolute position.

    The tables grow on demand, so positions beyond ``max_position_embeddings``
    still work (with the model's usual quality loss there).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        self.inv_freq = inverse_frequencies(cfg)
        self._cos = self._sin = torch.empty(0)
        self._build(max(cfg.max_position_embeddings, 1))

    def _build(self, length: int) -> None:
        t = torch.arange(length, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()

    def tables(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_dim]`` for ``positions`` ``[T]``, computed in
        float32 and cast to ``dtype`` (as the HF reference does).

        ``max_position`` is the largest entry of ``positions`` (known to the
        caller without a tensor reduction).
        """
        if max_position >= self._cos.shape[0]:
            self._build(2 * (max_position + 1))
        return self._cos[positions].unsqueeze(1).to(dtype), self._sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` by tables from :meth:`RotaryEmbedding.tables`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
