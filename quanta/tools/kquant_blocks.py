"""Random Q4_K and Q6_K blocks written directly, and the tensor types of a ``Q4_K_M`` / ``Q6_K`` file.

Block layouts (ggml's ``block_q4_K`` and ``block_q6_K``, 256 weights each):

- Q4_K, 144 bytes: fp16 ``d``, fp16 ``dmin``, 12 bytes of eight 6-bit scales and eight 6-bit mins,
  128 bytes of 4-bit codes. Weight ``i`` is ``d * sc[i // 32] * q[i] - dmin * m[i // 32]``. Scale and min
  ``j < 4`` sit in the low 6 bits of bytes ``j`` and ``j + 4``; for ``j >= 4`` their low 4 bits share byte
  ``j + 4`` (scale low, min high) and their top 2 bits are the top bits of bytes ``j - 4`` and ``j``. Codes
  come in four runs of 64 weights: byte ``32 c + l`` holds weight ``64 c + l`` low and ``64 c + 32 + l`` high.
- Q6_K, 210 bytes: ``ql`` 128 bytes (low 4 bits), ``qh`` 64 bytes (high 2 bits), 16 int8 scales, fp16 ``d``.
  Weight ``i`` is ``d * sc[i // 16] * (q[i] - 32)``. Each half of 128 weights uses 64 ``ql`` and 32 ``qh``
  bytes: ``ql[l]`` holds weights ``l`` (low) and ``64 + l`` (high), ``ql[32 + l]`` weights ``32 + l`` and
  ``96 + l``, ``qh[l]`` the high bits of ``l``, ``32 + l``, ``64 + l``, ``96 + l`` at bits 0, 2, 4, 6.

Random draws: codes uniform; Q4_K scales uniform in 12..33 with each min ``round(1.875 sc)`` and
``dmin = 4 d`` (so a sub-block's mean is ~0 while scales and mins are distinct numbers that use their top
bits), Q6_K scales of random sign and magnitude 16..127. ``d`` is set from the codes' and scales' exact
second moment so the weights have the requested std (up to fp16 rounding of ``d``). Rows from
``zero_from`` on are zero (``d = dmin = 0``), as the reserved tokens' rows of make-model's embeddings.

Tensor types of a file (:func:`tensor_type`) follow ``llama_tensor_get_type`` in llama.cpp's
``src/llama-quant.cpp``: in ``Q4_K_M``, Q4_K except the output matrix (or a tied token embedding) in Q6_K,
``attn_v`` and ``ffn_down`` in Q6_K in the layers ``use_more_bits`` picks (the first and last eighth and every
third between), ``attn_v`` / ``attn_k`` in Q8_0 for 8 experts; a row width not a multiple of 256 falls back to
Q5_0 (for Q4_K) or Q8_0 (for Q6_K), and to the output's Q8_0.
"""

from __future__ import annotations

import math
import re

import numpy as np

QK_K = 256
#: Q4_K's scale range and ``dmin / d``
_Q4K_SCALES, _Q4K_DMIN = (12, 33), 4
#: Q6_K's scale magnitudes
_Q6K_SCALES = (16, 127)
#: blocks drawn at a time (bounds the temporaries of a large tensor)
_CHUNK = 1 << 16


def _q4k_mins(sc: np.ndarray) -> np.ndarray:
    return np.rint(sc * 7.5 / _Q4K_DMIN).astype(np.uint8)


def q4_k_values(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The weights ``(blocks, 256)`` that Q4_K blocks of these fields mean (fp32)."""
    d, dmin = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    scale = np.repeat(d * sc.astype(np.float32), 32, axis=1)
    low = np.repeat(dmin * m.astype(np.float32), 32, axis=1)
    return scale * q.astype(np.float32) - low


def pack_q4_k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K blocks ``(blocks, 144)`` uint8 of fp16 ``d`` / ``dmin`` ``(blocks,)``, 6-bit ``sc`` / ``m``
    ``(blocks, 8)`` and 4-bit codes ``q`` ``(blocks, 256)``."""
    sc, m, q = sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)
    scales = np.empty((len(q), 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    runs = q.reshape(-1, 4, 2, 32)
    codes = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(-1, 128)
    halves = np.stack([d.astype(np.float16), dmin.astype(np.float16)], axis=1).view(np.uint8)
    return np.concatenate([halves, scales, codes], axis=1)


def q6_k_values(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The weights ``(blocks, 256)`` that Q6_K blocks of these fields mean (fp32)."""
    scale = np.repeat(d.astype(np.float32)[:, None] * sc.astype(np.float32), 16, axis=1)
    return scale * (q.astype(np.float32) - 32)


def pack_q6_k(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q6_K blocks ``(blocks, 210)`` uint8 of fp16 ``d`` ``(blocks,)``, int8 ``sc`` ``(blocks, 16)`` and
    6-bit codes ``q`` ``(blocks, 256)``."""
    parts = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # (block, half, quarter, l)
    low, high = parts & 15, parts >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                           d.astype(np.float16)[:, None].view(np.uint8)], axis=1)


def _unit_rms(qtype: str) -> float:
    """RMS of a weight over ``d`` for the random draw of ``qtype`` (exact, over the uniform grids)."""
    if qtype == "Q4_K":
        sc = np.arange(_Q4K_SCALES[0], _Q4K_SCALES[1] + 1, dtype=np.float64)[:, None]
        u = sc * np.arange(16) - _Q4K_DMIN * _q4k_mins(sc).astype(np.float64)
    else:
        sc = np.arange(_Q6K_SCALES[0], _Q6K_SCALES[1] + 1, dtype=np.float64)[:, None]
        u = sc * (np.arange(64) - 32)
    return float(np.sqrt(np.mean(u**2)))


def draw_fields(qtype: str, blocks: int, d: float, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Random fields of ``blocks`` blocks with scale ``d``: Q4_K ``(d, dmin, sc, m, q)``, Q6_K ``(d, sc, q)``."""
    scale = np.full(blocks, d, np.float16)
    if qtype == "Q4_K":
        sc = rng.integers(_Q4K_SCALES[0], _Q4K_SCALES[1] + 1, (blocks, 8), dtype=np.uint8)
        q = rng.integers(0, 16, (blocks, QK_K), dtype=np.uint8)
        return scale, (scale * np.float16(_Q4K_DMIN)).astype(np.float16), sc, _q4k_mins(sc), q
    sign = np.where(rng.integers(0, 2, (blocks, 16)) == 1, 1, -1)
    sc = (sign * rng.integers(_Q6K_SCALES[0], _Q6K_SCALES[1] + 1, (blocks, 16))).astype(np.int8)
    return scale, sc, rng.integers(0, 64, (blocks, QK_K), dtype=np.uint8)


def random_blocks(qtype: str, shape: tuple[int, ...], std: float, rng: np.random.Generator,
                  zero_from: int | None = None) -> np.ndarray:
    """A ``qtype`` (Q4_K or Q6_K) tensor of numpy ``shape`` with random weights of ``std``, as stored:
    uint8 ``(*shape[:-1], shape[-1] // 256 * block bytes)``; rows ``zero_from:`` (of a 2-D shape) are zero.

    Raises:
        ValueError: the row width is not a multiple of 256.
    """
    if shape[-1] % QK_K:
        raise ValueError(f"{qtype} needs rows of a multiple of {QK_K} weights, not {shape[-1]}")
    per_row, rows = shape[-1] // QK_K, math.prod(shape[:-1])
    d = float(np.float16(std / _unit_rms(qtype)))
    out = []
    for start in range(0, rows * per_row, _CHUNK):
        fields = draw_fields(qtype, min(_CHUNK, rows * per_row - start), d, rng)
        if zero_from is not None:
            row = (start + np.arange(len(fields[0]))) // per_row
            for f in fields[:2 if qtype == "Q4_K" else 1]:
                f[row >= zero_from] = 0
        out.append(pack_q4_k(*fields) if qtype == "Q4_K" else pack_q6_k(*fields))
    return np.concatenate(out).reshape(*shape[:-1], -1)


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fallback(qtype: str, cols: int) -> str:
    """``qtype``, or llama-quantize's replacement where rows of ``cols`` do not fill its blocks."""
    if qtype in ("Q4_K", "Q6_K") and cols % QK_K:
        qtype = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[qtype]
    return qtype if cols % 32 == 0 else "F16"


def tensor_type(ftype: str, name: str, shape: tuple[int, ...], cfg: dict) -> str:
    """The ggml type of matrix ``name`` (numpy ``shape``) in a ``Q4_K_M`` or ``Q6_K`` file of ``cfg``.

    Raises:
        ValueError: the file would need a type make-model does not write (Q5_K: ``attn_qkv``, 8-expert ``attn_output``).
    """
    cols, experts = shape[-1], cfg.get("num_experts") or 0
    layer = int(m.group(1)) if (m := re.match(r"blk\.(\d+)\.", name)) else -1
    role = name.split(".")[-2] if layer >= 0 else name.split(".")[0]
    tied = cfg["tie_word_embeddings"]
    if role == "output" or (tied and role == "token_embd"):
        return "Q8_0" if cols % QK_K else "Q6_K"
    if ftype == "Q6_K":
        return _fallback("Q6_K", cols)
    more = _use_more_bits(layer, cfg["num_hidden_layers"])
    if role == "attn_qkv" or (role == "attn_output" and experts == 8):
        raise ValueError(f"{name} is Q5_K in a Q4_K_M file, which make-model does not write directly")
    if role in ("attn_v", "attn_k") and experts == 8:
        return "Q8_0"
    if role in ("attn_v", "ffn_down", "ffn_down_exps") and more:
        return _fallback("Q6_K", cols)
    return _fallback("Q4_K", cols)
