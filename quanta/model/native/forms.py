"""GGUF block forms (Q4_1, Q8_0; Q6_K, converted from a GGUF's own Q6_K blocks only) packed for
``qmatmul.c``, and their matmul; the fp16 form's matmul (``f16matmul.c``).

Both take blocks of 32 weights along the input dimension ``K`` with fp16
scales, as GGUF stores them (Q4_1: ``w = d * q + m``, ``q`` in [0, 15];
Q8_0: ``w = d * q``, ``q`` in [-127, 127]), interleaved by groups of 8
output columns so that the kernel's vector lanes are columns (layout in
``qmatmul.c``). A Q4_1 or Q8_0 tensor of a GGUF file, dequantized by the
loader and packed here, gets back its own blocks up to the fp16 rounding of
the scales (the block min and max are among its values).
"""

from __future__ import annotations

import ctypes

import torch

from quanta.model import native

BLOCK = 32


def available() -> bool:
    """Whether the C kernels build and load on this machine."""
    try:
        native.load()
    except native.NativeUnavailable:
        return False
    return True


def pack(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(data, scales)`` of a float ``[N, K]`` weight in ``kind`` (``q4_1`` / ``q8_0``).

    None where the kernels cannot take it: ``N`` not a multiple of 8, ``K``
    not of 32, or no C library here.
    """
    n, k = w.shape
    if n % 8 or k % BLOCK or not available():
        return None
    blocks = w.float().view(n, k // BLOCK, BLOCK)
    return _pack_q4_1(blocks) if kind == "q4_1" else _pack_q8_0(blocks)


def _by_group(t: torch.Tensor) -> torch.Tensor:
    """``[N, B, ...]`` -> ``[N / 8, B, 8, ...]`` (columns of a group innermost but one)."""
    n, b = t.shape[:2]
    return t.view(n // 8, 8, b, *t.shape[2:]).transpose(1, 2)


def _pack_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True)
    d, m = ((hi - lo) / 15).half().float(), lo.half().float()
    q = _by_group(torch.round((blocks - m) / d.clamp(min=1e-12)).clamp(0, 15).to(torch.uint8))  # [G, B, c, 32]
    g, b = q.shape[:2]
    low, high = (h.reshape(g, b, 8, 4, 4).permute(0, 1, 3, 2, 4) for h in (q[..., :16], q[..., 16:]))  # [G, B, i, c, j]
    data = (low | (high << 4)).reshape(g, b, 128).contiguous()
    scales = torch.stack([_by_group(d[..., 0]), _by_group(m[..., 0])], dim=2).half().contiguous()  # [G, B, 2, c]
    return data, scales


def _pack_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = (blocks.abs().amax(dim=-1, keepdim=True) / 127).half().float()
    q = _by_group(torch.round(blocks / d.clamp(min=1e-12)).clamp(-127, 127).to(torch.int8))  # [G, B, c, 32]
    g, b = q.shape[:2]
    data = q.reshape(g, b, 8, 8, 4).permute(0, 1, 3, 2, 4).reshape(g, b, 256).contiguous()  # [G, B, i, c, j]
    return data, _by_group(d[..., 0]).half().contiguous()  # [G, B, c]


def matmul(kind: str, x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, fine: bool = True,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (bf16 or float32; others computed in float32) -> ``[M, N]`` in that dtype.

    ``fine``: activations quantized to 15 bits per block of 32 (within ~3e-5 of the float
    product), else to 8 bits (llama.cpp's Q8_1: ~0.5%, and about 1.4x faster a decode step).
    ``lib``: the library to call (default :func:`quanta.model.native.load`; tests pass
    one built for another ``-march``)."""
    x = _io_rows(x)
    rows, k = x.shape
    n = data.shape[0] * 8
    lib = lib or native.load()
    out, quantized, work, sums = _block_buffers(lib, rows, k, n, x.dtype)
    _done(lib.block_matmul(
        native.KINDS[kind], int(fine), rows, n, k, x.data_ptr(), int(x.dtype == torch.bfloat16), data.data_ptr(),
        scales.data_ptr(), out.data_ptr(), quantized.data_ptr(), work.data_ptr(), sums))
    return out


def _done(code: int) -> None:
    """A block_matmul call's result: -1 where its scratch could not be allocated."""
    if code != 0:
        raise MemoryError("qmatmul.c could not allocate its scratch")


def _io_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the C kernels take rows: bf16 or float32 (others widened to float32), contiguous."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.float()
    return x if x.is_contiguous() else x.contiguous()


def _block_buffers(lib: ctypes.CDLL, rows: int, k: int, n: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``block_matmul``'s output ``[rows, n]`` in ``dtype`` and scratch for ``rows`` x ``k``: the
    quantized activations (two bytes each), the float work (activation scales, then for bf16 output
    the float sums, ``lib.block_sums_scratch``; float32 output takes the sums itself) and the sums'
    address in it."""
    out = torch.empty(rows, n, dtype=dtype)
    quantized = torch.empty(rows * 2 * k, dtype=torch.int8)
    sums = lib.block_sums_scratch(rows, n) if dtype == torch.bfloat16 else 0
    work = torch.empty(rows * (k // BLOCK) * 2 + sums, dtype=torch.float32)
    return out, quantized, work, work.data_ptr() + rows * (k // BLOCK) * 2 * 4


def matmul_experts(kind: str, x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, fine: bool, n: int,
                   groups: list[tuple[int, int]]) -> torch.Tensor:
    """Routed experts in one call: ``groups`` is ``(expert, rows)`` pairs in ``x``'s row order, and
    those rows of ``x`` ``[M, K]`` are multiplied by expert ``expert``'s ``[n, K]`` rows of the form
    ``data`` / ``scales`` (every expert's ``n`` rows one after another, as
    :meth:`~quanta.model.quant.QuantizedWeight.part` cuts them) -> ``[M, N]`` in ``x``'s dtype; each
    row as :func:`matmul` computes it on its expert alone."""
    x = _io_rows(x)
    rows, k = x.shape
    experts = torch.tensor([e for e, _ in groups], dtype=torch.int32)
    counts = torch.tensor([n for _, n in groups], dtype=torch.int32)
    if int(counts.sum()) != rows or n % 8 or not all(0 <= e < data.shape[0] * 8 // n for e, _ in groups):
        raise ValueError(f"groups {groups} of {n}-row experts do not fit x's {rows} rows and a form of {data.shape[0] * 8}")
    lib = native.load()
    out, quantized, work, sums = _block_buffers(lib, rows, k, n, x.dtype)
    _done(lib.block_matmul_experts(
        native.KINDS[kind], int(fine), len(groups), counts.data_ptr(), experts.data_ptr(), n, k, x.data_ptr(),
        int(x.dtype == torch.bfloat16), data.data_ptr(), scales.data_ptr(), out.data_ptr(), quantized.data_ptr(),
        work.data_ptr(), sums))
    return out


def f16_matmul(x: torch.Tensor, w: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (bf16 or float32; others computed in float32) times the fp16 weight ``w``
    ``[N, K]`` (float32: ``f32_matmul``, the same tiles) -> ``[M, N]`` in ``x``'s dtype, by
    ``f16matmul.c``: float32 products and sums, each row computed the same in a call of any size
    and on any thread. ``lib`` as in :func:`matmul`."""
    if w.dtype not in (torch.float16, torch.float32) or not w.is_contiguous():
        raise ValueError(f"f16_matmul takes a contiguous fp16 or float32 weight, got {w.dtype}")
    x = _io_rows(x)
    rows, k = x.shape
    io_bf16 = x.dtype == torch.bfloat16
    out = torch.empty(rows, w.shape[0], dtype=x.dtype)
    widened = torch.empty(rows * k if io_bf16 else 0, dtype=torch.float32)  # bf16 rows as float32
    lib = lib or native.load()
    call = lib.f32_matmul if w.dtype == torch.float32 else lib.f16_matmul
    call(rows, w.shape[0], k, x.data_ptr(), int(io_bf16), w.data_ptr(), out.data_ptr(), widened.data_ptr())
    return out


def dense(kind: str, data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``[N, K]`` weight that ``data`` and ``scales`` hold, in ``dtype`` (bf16, else float32),
    rebuilt by the C library (``dequant.c``): what a prompt chunk multiplies by where the
    reference weight is not kept. Equal to :func:`dequantize` up to float32 rounding (q6_k: rebuilt
    by it)."""
    if kind == "q6_k":
        return dequantize(kind, data, scales).to(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    g, b = data.shape[:2]
    out = torch.empty(g * 8, b * BLOCK, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    native.load().block_dense(4 if kind == "q4_1" else 8, g * 8, b * BLOCK, data.data_ptr(), scales.data_ptr(),
                              out.data_ptr(), int(out.dtype == torch.bfloat16))
    return out


def dequantize(kind: str, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, K]`` weight that ``data`` and ``scales`` hold."""
    g, b = data.shape[:2]
    if kind == "q6_k":
        return q6_k_rows(data, scales).reshape(g * 8, b * BLOCK)
    if kind == "q4_1":
        cells = data.view(g, b, 4, 8, 4)  # [G, B, i, c, j]
        q = torch.cat([cells & 15, cells >> 4], dim=2)  # [G, B, 8 (i, then i + 4 for the high nibbles), c, j]
        d, m = scales[:, :, 0].float(), scales[:, :, 1].float()  # [G, B, c]
    else:
        q = data.view(g, b, 8, 8, 4)
        d = scales.float()
        m = torch.zeros_like(d)
    q = q.permute(0, 3, 1, 2, 4).reshape(g * 8, b, BLOCK).float()  # [N, B, 32]
    d, m = (t.permute(0, 2, 1).reshape(g * 8, b, 1) for t in (d, m))  # [N, B, 1]
    return (q * d + m).reshape(g * 8, b * BLOCK)


#: for q6_k's 8 unpacked chunks of 4 k, (s, i) with k = 16 s + 4 i + j: the shift of its top bits in its byte
_Q6_SHIFTS = torch.tensor([[2 * (2 * (i % 2) + s) for i in range(4)] for s in range(2)], dtype=torch.uint8)


def q6_k_rows(data: torch.Tensor, scales: torch.Tensor, column: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights of q6_k groups ``data`` ``[..., B, 208]`` with ``scales`` ``[..., B / 8, 8]``
    (layout in ``qmatmul.c``): ``(d * s) * (u - 32)``, the product GGUF's Q6_K dequantization
    computes; ``[..., 8, B, 32]`` (column, block, k), or with ``column`` (int64 ``[T]``, groups
    ``[T, B, 208]``) each group's one column, ``[T, B, 32]``."""
    ql = data[..., :128].unflatten(-1, (4, 8, 4))  # [..., B, i, c, j]
    qh = data[..., 128:192].unflatten(-1, (2, 8, 4))  # [..., B, half, c, j]
    sc = data[..., 192:208].view(torch.int8).unflatten(-1, (2, 8))  # [..., B, h, c]
    d = scales
    if column is not None:  # keep only each group's column c, as a column dim of 1
        rows = torch.arange(column.shape[0])
        ql, qh = (t[rows, :, :, column, :].unsqueeze(-2) for t in (ql, qh))
        sc, d = sc[rows, :, :, column].unsqueeze(-1), d[rows, :, column].unsqueeze(-1)
    nib = torch.stack([ql & 15, ql >> 4], dim=-4)  # [..., B, s, i, c, j]
    top = (qh[..., [0, 0, 1, 1], :, :].unsqueeze(-4) >> _Q6_SHIFTS[:, :, None, None]) & 3  # byte of chunk (s, i): i // 2
    u = (nib | top << 4).movedim(-2, -4).flatten(-3).float()  # [..., B, c, 32]
    ds = (d.float().repeat_interleave(8, dim=-2).unsqueeze(-2) * sc.float()).repeat_interleave(16, dim=-2)  # [..., B, 32, c]
    values = (ds.transpose(-1, -2) * (u - 32)).movedim(-3, -2)  # [..., c, B, 32]
    return values.squeeze(-3) if column is not None else values
