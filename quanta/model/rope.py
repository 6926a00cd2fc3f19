"""Rotary position embedding (rotate-half form, as in HF Llama) with optional scaling.

``cfg.rope_scaling`` is HF's ``rope_scaling`` dict (its ``rope_type`` and parameters) plus what
GGUF files carry:

- ``default`` (or no dict): the plain frequencies ``theta ** (-2i / head_dim)``.
- ``linear``: frequencies divided by ``factor`` (positions interpolated).
- ``llama3``: Llama 3.1's band-wise rule from its HF parameters
  (``transformers.modeling_rope_utils._compute_llama3_parameters``).
- ``yarn``: YaRN (``factor``, ``original_max_position_embeddings``, optional ``beta_fast`` /
  ``beta_slow``, 32 / 1 by default): each frequency a mix of the interpolated one
  (divided by ``factor``) and the original, the mix ramping over the dimensions whose
  wavelengths make between ``beta_fast`` and ``beta_slow`` turns in the original context
  (``rope_yarn`` of llama.cpp's ``ggml-cpu/ops.cpp``, ``_compute_yarn_parameters`` of
  transformers); cos and sin are multiplied by :func:`attention_factor`.
- ``freq_factors``: no scaling of its own, only ``freq_factors`` (below): Llama 3.x GGUF files,
  whose converter turned the ``llama3`` rule into a ``rope_freqs`` tensor.
- ``longrope`` (Phi-3 / Phi-3.5): each frequency divided by its factor from ``long_factor`` where
  the context the model serves (``context``, default ``max_position_embeddings``) exceeds
  ``original_max_position_embeddings``, else from ``short_factor`` (llama.cpp's choice by
  context size, ``llama_model::get_rope_factors``); cos and sin multiplied by ``attention_factor``.

Any type may also carry ``freq_factors`` (``head_dim // 2`` floats, llama.cpp's
``rope_freqs.weight``: each frequency is divided by its factor before the type's own scaling,
as ``ggml_rope_ext`` does) and ``attention_factor`` (multiplies cos and sin, replacing the one
YaRN derives).
"""

from __future__ import annotations

import math

import torch

from quanta.model.config import ModelConfig

#: ``rope_type`` values :func:`inverse_frequencies` computes
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors", "longrope")


def rope_type(cfg: ModelConfig) -> str:
    """The ``rope_type`` of ``cfg.rope_scaling`` (legacy ``type`` read too; ``default`` without one)."""
    scaling = cfg.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def inverse_frequencies(cfg: ModelConfig, context: int | None = None) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, scaled per ``cfg.rope_scaling``
    (computed in float64, then rounded once); ``context``: the served context length, which
    picks ``longrope``'s factors (default ``cfg.max_position_embeddings``).

    Raises:
        ValueError: an unsupported ``rope_type``, or ``freq_factors`` of the wrong length.
    """
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = rope_type(cfg)
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    if scaling.get("freq_factors") is not None:
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float64).reshape(-1)
        if factors.numel() != inv.numel():
            raise ValueError(f"rope freq_factors has {factors.numel()} values; head_dim {dim} needs {inv.numel()}")
        inv = inv / factors
    if kind == "longrope":
        inv = inv / _longrope_factors(scaling, context or cfg.max_position_embeddings, inv.numel())
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        inv = _llama3(inv, scaling)
    elif kind == "yarn":
        inv = _yarn(inv, scaling, cfg)
    return inv.float()


def attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: ``rope_scaling["attention_factor"]`` where given, else
    :func:`yarn_attention_factor` for ``yarn``, else 1."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if rope_type(cfg) == "yarn":
        return yarn_attention_factor(_yarn_factor(scaling, cfg), scaling.get("mscale"), scaling.get("mscale_all_dim"))
    return 1.0


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's magnitude scale ``0.1 ln(factor) + 1`` (1 for ``factor <= 1``); with both ``mscale`` and
    ``mscale_all_dim`` the ratio of the two so scaled (transformers' and llama.cpp's rule, DeepSeek-style)."""

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


def _longrope_factors(s: dict, context: int, n: int) -> torch.Tensor:
    """``long_factor`` where ``context`` exceeds ``original_max_position_embeddings``, else
    ``short_factor``; a missing list means no factors (as llama.cpp without the tensor)."""
    long = context > s["original_max_position_embeddings"]
    factors = s.get("long_factor" if long else "short_factor")
    if factors is None:
        return torch.ones(n, dtype=torch.float64)
    out = torch.tensor(factors, dtype=torch.float64).reshape(-1)
    if out.numel() != n:
        raise ValueError(f"rope {'long' if long else 'short'}_factor has {out.numel()} values; head_dim needs {n}")
    return out


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


def _yarn_factor(s: dict, cfg: ModelConfig) -> float:
    """YaRN's ``factor``; transformers derives a missing one from the two context lengths."""
    return s.get("factor") or cfg.max_position_embeddings / _yarn_original_length(s, cfg)


def _yarn_original_length(s: dict, cfg: ModelConfig) -> int:
    return s.get("original_max_position_embeddings") or cfg.max_position_embeddings


def _yarn(inv: torch.Tensor, s: dict, cfg: ModelConfig) -> torch.Tensor:
    """YaRN's frequencies: dimension pair ``i`` keeps ``ramp(i)`` of its own frequency and takes
    ``1 - ramp(i)`` of it divided by ``factor``; ``ramp`` falls from 1 to 0 between the pairs
    whose wavelengths fit ``beta_fast`` and ``beta_slow`` turns in the original context
    (floored / ceiled, as llama.cpp does and transformers does by default)."""
    dim, base, original = cfg.head_dim, cfg.rope_theta, _yarn_original_length(s, cfg)

    def pair_of(turns: float) -> float:  # the pair whose wavelength fits `turns` turns in `original`
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_of(s.get("beta_fast") or 32.0), pair_of(s.get("beta_slow") or 1.0)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pairs = torch.arange(inv.numel(), dtype=torch.float64)
    ramp = 1 - ((pairs - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv / _yarn_factor(s, cfg) * (1 - ramp) + inv * ramp


class RotaryEmbedding:
    """cos/sin tables, indexed by absolute position, scaled by :func:`attention_factor`.

    The tables start at :attr:`INITIAL_POSITIONS` positions (or the model's
    ``max_position_embeddings`` when shorter) and double past the largest
    position asked for, so a 128K-context model does not hold 128K rows
    (134 MB for Llama 3.1) before a sequence needs them; positions beyond
    ``max_position_embeddings`` work too (with the model's usual quality loss there).
    """

    #: positions the first tables cover
    INITIAL_POSITIONS = 4096

    def __init__(self, cfg: ModelConfig, context: int | None = None) -> None:
        self.inv_freq = inverse_frequencies(cfg, context)
        self.attention_factor = attention_factor(cfg)
        self._cos = self._sin = torch.empty(0)
        self._build(min(max(cfg.max_position_embeddings, 1), self.INITIAL_POSITIONS))

    def _build(self, length: int) -> None:
        t = torch.arange(length, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            self._cos.mul_(self.attention_factor)
            self._sin.mul_(self.attention_factor)

    def float32_tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole float32 cos and sin tables, ``[L, head_dim]`` contiguous with ``L > max_position``
        (grown first when needed): row ``p`` is position ``p``, its two halves equal. A growth
        replaces the tensors, so a holder of their memory keeps the returned ones alive."""
        if max_position >= self._cos.shape[0]:
            self._build(2 * (max_position + 1))
        return self._cos, self._sin

    def tables(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_dim]`` for ``positions`` ``[T]``, computed in
        float32 and cast to ``dtype`` (as the HF reference does).

        ``max_position`` is the largest entry of ``positions`` (known to the
        caller without a tensor reduction).
        """
        cos, sin = self.float32_tables(max_position)
        return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` by tables from :meth:`RotaryEmbedding.tables`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
