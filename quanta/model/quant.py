"""Weight-only quantized matmuls for small row counts (decode steps).

A decode step reads every weight once for a handful of rows, so its cost is
the bytes it reads: fp32 SmolLM2-135M is ~540 MB a step, bf16 ~270 MB, int8
~135 MB, int4 ~70 MB. These kernels multiply activations by int8 / int4
weights directly (PyTorch's own CPU kernels ``aten._weight_int8pack_mm`` and
``aten._weight_int4pack_mm_for_cpu``), but they do the arithmetic row by row
block, so past a few rows the dequantized reference GEMM (oneDNN / MKL) is
faster; :func:`max_quantized_rows` gives that crossover.

Formats:

- ``int8``: symmetric per output channel, ``w[n, k] = q[n, k] * scale[n]``,
  ``q`` in [-127, 127].
- ``int4``: asymmetric in groups of 32 along the input dimension,
  ``w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`` with ``g = k // 32``
  and ``q`` in [0, 15] — the same form as GGUF's Q4_0 / Q4_1 / Q4_K blocks
  (``d * q + m`` per 32 weights), so a Q4_1 tensor requantized here recovers
  its own blocks up to the bf16 rounding of the scales.

Both kernels are fast only with bf16 activations (their fp32 paths are
scalar, 10-30x slower), so fp32 activations are cast to bf16 around the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: quantization names accepted by ``--quantization`` (``auto`` resolved by the loader)
QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP = 32

#: Largest row count at which the quantized kernel beat the reference GEMM,
#: per (quantization, reference is bf16). Measured with
#: ``benchmarks/quant_kernels.py`` (results in ``benchmarks/results/quant_kernels_*.md``)
#: on the 2-core AMD EPYC dev VM: bf16 (AVX-512 + bf16), whole decode step
#: int4/int8 vs reference 17.2 vs 27.5 ms at 1 row, 19.5 vs 29.4 at 4, 34.2 vs
#: 28.7 at 8; fp32 with AVX2 dispatch forced (ATEN_CPU_CAPABILITY=avx2,
#: ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2), 19.3 vs 55.8 ms at 1
#: row, 63 vs 113 at 16, 130 vs 156 at 32 (int8 alone: 142 vs 156).
_MAX_ROWS = {("int8", True): 4, ("int8", False): 32, ("int4", True): 4, ("int4", False): 32}


def max_quantized_rows(quantization: str, bf16_reference: bool) -> int:
    """Row count up to which :class:`QuantizedWeight` is used (see ``_MAX_ROWS``):
    the crossover against a bf16 oneDNN-packed reference or an fp32 MKL one."""
    return _MAX_ROWS[(quantization, bf16_reference)]


@dataclass
class QuantizedWeight:
    """A ``[N, K]`` weight in ``int8`` or ``int4`` form; call it on ``[M, K]`` rows.

    Attributes:
        kind: ``int8`` or ``int4``.
        data: int8 ``[N, K]``, or the int4 kernel's packed layout.
        scales: int8: bf16 ``[N]``; int4: bf16 ``[K / 32, N, 2]`` (scale, zero).
        max_rows: the largest ``M`` the caller should send here.
    """

    kind: str
    data: torch.Tensor
    scales: torch.Tensor
    max_rows: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, K]`` -> ``[M, N]`` in ``x``'s dtype (computed with bf16 activations)."""
        xb = x.to(torch.bfloat16) if x.dtype != torch.bfloat16 else x
        xb = xb if xb.is_contiguous() else xb.contiguous()
        if self.kind == "int8":
            out = torch.ops.aten._weight_int8pack_mm(xb, self.data, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.data, INT4_GROUP, self.scales)
        return out if x.dtype == torch.bfloat16 else out.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[N, K]`` weight this form represents (for tests and checks)."""
        if self.kind == "int8":
            return self.data.float() * self.scales.float()[:, None]
        n = self.scales.shape[1]
        eye = torch.eye(self.scales.shape[0] * INT4_GROUP, dtype=torch.bfloat16)
        return self(eye).float().t().reshape(n, -1)


def quantize(weight: torch.Tensor, kind: str, max_rows: int) -> QuantizedWeight | None:
    """Quantize a ``[N, K]`` weight; None where the kernel cannot take it.

    int4 needs ``K`` divisible by 32 and ``N`` by 16 (the kernel's tiling);
    int8 takes any shape. A kernel missing from this torch build gives None.
    """
    w = weight.detach().float()
    try:
        if kind == "int8":
            return _int8(w, max_rows)
        if kind == "int4" and w.shape[1] % INT4_GROUP == 0 and w.shape[0] % 16 == 0:
            return _int4(w, max_rows)
    except (RuntimeError, AttributeError):
        return None
    return None


def _int8(w: torch.Tensor, max_rows: int) -> QuantizedWeight:
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    qw = QuantizedWeight("int8", q, scales.to(torch.bfloat16), max_rows)
    torch.ops.aten._weight_int8pack_mm(torch.zeros(1, w.shape[1], dtype=torch.bfloat16), q, qw.scales)  # kernel exists
    return qw


def _int4(w: torch.Tensor, max_rows: int) -> QuantizedWeight:
    n, k = w.shape
    groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((groups - lo) / scale).clamp(0, 15).to(torch.int32).view(n, k)
    zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
    scale_zero = torch.stack([scale.view(n, -1).t(), zero.view(n, -1).t()], dim=-1).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    return QuantizedWeight("int4", packed, scale_zero.to(torch.bfloat16), max_rows)
