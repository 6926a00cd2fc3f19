"""One GGUF tensor's raw blocks straight into a C form (``q4_1``, ``q6_k``, ``q8_0``, ``fp16``), by
``repack.c``: no float copy of the tensor is made, so a loader holds the forms plus one tensor's
bytes.

Conversions (details and bounds in ``repack.c``):

- ``q4_1`` from Q4_0 and Q4_1 exactly; from Q4_K with each sub-block's ``d * sc`` and
  ``dmin * m`` rounded to fp16 (a weight moves by at most ``15 e(d sc) + e(dmin m)``,
  ``e(x) = max(|x| 2^-11, 2^-25)``).
- ``q6_k`` from Q6_K exactly (its 6-bit values, int8 scales per 16 and fp16 ``d``, interleaved).
- ``q8_0`` from Q8_0, Q5_0 and Q4_0 exactly; from Q4_1, Q5_1, Q4_K, Q5_K and Q6_K by
  requantizing each block of 32 float values (``|w - d8 q| <= d8 / 2``, ``d8 = fp16(max|w| / 127)``).
- ``fp16`` (a plain ``[N, K]`` matrix) from F16 exactly, from BF16 rounded to nearest even.

The result is laid out as :func:`quanta.model.native.forms.pack` lays out the same kind, in numpy
arrays (:func:`empty_arrays`; this module imports no torch, so a load can convert weights while torch
is still being imported, :mod:`quanta.model.gguf_prefetch`) or torch tensors (:func:`empty_form`).
"""

from __future__ import annotations

import mmap

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from quanta.model import native

#: the forms each source type converts to, its natural one first
_TARGETS = {"Q4_0": ("q4_1", "q8_0"), "Q4_1": ("q4_1", "q8_0"), "Q4_K": ("q4_1", "q8_0"), "Q5_0": ("q8_0",), "Q5_1": ("q8_0",),
            "Q5_K": ("q8_0",), "Q6_K": ("q6_k", "q8_0"), "Q8_0": ("q8_0",), "F16": ("fp16",), "BF16": ("fp16",)}
#: ggml type ids of the source types (repack.c's), and (values, bytes) per block
_TYPES = {name: int(GGMLQuantizationType[name]) for name in _TARGETS}
_BLOCKS = {name: GGML_QUANT_SIZES[GGMLQuantizationType[name]] for name in _TARGETS}
_KIND_IDS = {**native.KINDS, "fp16": 16}  # repack.c's TO_* are qmatmul.c's kinds

SUPPORTED = frozenset(_TYPES)


def natural_kind(ggml_type: str) -> str | None:
    """The form a tensor of ``ggml_type`` converts to by default: ``q4_1`` for the 4-bit types (exact
    but for Q4_K's sub-block scales, rounded to fp16), ``q6_k`` for Q6_K (exact), ``q8_0`` for the
    5- and 8-bit ones, ``fp16`` for F16 / BF16; None for a type with no conversion."""
    return _TARGETS[ggml_type][0] if ggml_type in _TARGETS else None


def row_bytes(ggml_type: str, k: int) -> int:
    """Bytes of one ``k``-value row of ``ggml_type`` (``k`` a multiple of its block)."""
    values, size = _BLOCKS[ggml_type]
    return k // values * size


def _check(ggml_type: str, n: int, k: int, kind: str) -> None:
    if ggml_type not in SUPPORTED:
        raise ValueError(f"GGUF type {ggml_type} has no conversion to a C form (supported: {', '.join(sorted(SUPPORTED))})")
    if kind not in _TARGETS[ggml_type]:
        raise ValueError(f"GGUF type {ggml_type} converts to {' / '.join(_TARGETS[ggml_type])}, not {kind}")
    block = _BLOCKS[ggml_type][0]
    if n <= 0 or k <= 0 or k % block:
        raise ValueError(f"{ggml_type} tensor [{n}, {k}]: k must be a positive multiple of {block}")
    if kind != "fp16" and (n % 8 or k % 32):
        raise ValueError(f"{kind} form of [{n}, {k}]: n must be a multiple of 8 and k of 32")


def _as_bytes(raw, ggml_type: str, n: int, k: int) -> np.ndarray:
    buf = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype=np.uint8)
    buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    if buf.size != n * row_bytes(ggml_type, k):
        raise ValueError(f"{ggml_type} tensor [{n}, {k}] takes {n * row_bytes(ggml_type, k)} bytes, got {buf.size}")
    return buf


def _as_rows(rows: np.ndarray | None, n: int) -> np.ndarray | None:
    if rows is None:
        return None
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    if rows.shape != (n,) or (n and (rows.min() < 0 or rows.max() >= n)):
        raise ValueError(f"row map must be {n} source rows in [0, {n}), got shape {rows.shape}")
    return rows


def layout(kind: str, n: int, k: int) -> tuple[tuple[tuple[int, ...], np.dtype], tuple[tuple[int, ...], np.dtype]]:
    """``((shape, dtype), (shape, dtype))`` of form ``kind``'s data and scales for an ``[n, k]`` weight;
    rows ``[i, j)`` (multiples of 8) are the slices ``[i // 8 : j // 8]`` of both (``[i:j]`` of fp16's matrix)."""
    f16, g, b = np.dtype(np.float16), n // 8, k // 32
    if kind == "fp16":
        return ((n, k), f16), ((0,), np.dtype(np.float32))
    if kind == "q4_1":
        return ((g, b, 128), np.dtype(np.uint8)), ((g, b, 2, 8), f16)
    if kind == "q6_k":
        return ((g, b, 208), np.dtype(np.uint8)), ((g, k // 256, 8), f16)
    return ((g, b, 256), np.dtype(np.int8)), ((g, b, 8), f16)


def empty_arrays(kind: str, n: int, k: int, populate: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Numpy ``(data, scales)`` of form ``kind`` (:func:`layout`), to be overwritten, each in private
    anonymous pages of its own, with ``populate`` made resident in one call (``MAP_POPULATE``, without
    the GIL): faulting them in one by one from the conversion's threads cost twice that (1.3 GB: ~0.76 s
    against ~0.43 s, a 2-core AMD EPYC VM), but a populating call holds the memory map lock that other
    threads' ``mmap`` calls wait for (:mod:`quanta.model.gguf_prefetch` converts beside imports without
    it). ``np.empty`` asks for huge pages from 4 MiB on, whose first touch took 0.4-3.2 s (the kernel
    compacting memory for them)."""
    return tuple(_resident(shape, dtype, populate) for shape, dtype in layout(kind, n, k))


def _resident(shape: tuple[int, ...], dtype: np.dtype, populate: bool) -> np.ndarray:
    size = int(np.prod(shape)) * dtype.itemsize
    if size == 0:
        return np.empty(shape, dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return np.frombuffer(mmap.mmap(-1, size, flags=flags), dtype=dtype).reshape(shape)


def empty_form(kind: str, n: int, k: int) -> tuple:
    """Uninitialised torch ``(data, scales)`` of form ``kind`` (:func:`layout`)."""
    import torch  # here: the module itself is imported before torch is (a load beside the imports)

    return tuple(torch.from_numpy(a) for a in empty_arrays(kind, n, k))


def to_form(raw, ggml_type: str, n: int, k: int, kind: str, rows: np.ndarray | None = None, out: tuple | None = None) -> tuple:
    """``(data, scales)`` of form ``kind`` from the raw bytes ``raw`` (a uint8 numpy array or any
    bytes-like object) of a GGUF ``[n, k]`` tensor of type ``ggml_type`` (e.g. ``"Q4_K"``), laid
    out as :func:`quanta.model.native.forms.pack` lays out ``kind``; for ``fp16``, the ``[n, k]``
    fp16 matrix and an empty tensor. ``rows``: output row ``i`` is the file's row ``rows[i]``
    (int32 ``[n]``; None: the file's order). ``out``: where to write, as :func:`empty_form` (torch)
    or :func:`empty_arrays` (numpy) give it or contiguous row slices of a larger one (fused
    projections are written in place, not concatenated); None: new torch tensors. Runs on the C
    pool's threads.

    Raises:
        ValueError: a type or kind with no conversion, a shape the form cannot take (``n % 8``,
            ``k % 32``, ``k`` not a multiple of the type's block), a buffer of the wrong size, or
            a bad row map.
        quanta.model.native.NativeUnavailable: no C library here.
    """
    _check(ggml_type, n, k, kind)
    buf, row_map = _as_bytes(raw, ggml_type, n, k), _as_rows(rows, n)
    data, scales = out if out is not None else empty_form(kind, n, k)
    if (tuple(data.shape), tuple(scales.shape)) != tuple(shape for shape, _ in layout(kind, n, k)) or not (
            _contiguous(data) and _contiguous(scales)):
        raise ValueError(f"out must be contiguous {kind} tensors of [{n}, {k}]")
    done = native.load().gguf_repack(_TYPES[ggml_type], _KIND_IDS[kind], n, k, buf.ctypes.data,
                                     None if row_map is None else row_map.ctypes.data, _address(data), _address(scales))
    if done != 0:
        raise ValueError(f"repack.c has no conversion from {ggml_type} to {kind}")
    return data, scales


def _contiguous(a) -> bool:
    return a.flags.c_contiguous if isinstance(a, np.ndarray) else a.is_contiguous()


def _address(a) -> int:
    """Where a numpy array's or a torch tensor's data starts."""
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr()
