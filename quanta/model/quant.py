"""Weight forms for small and medium row counts: int8, int4 and fp16 copies.

A decode step reads every weight once for a handful of rows, so its cost is
the bytes it reads: fp32 SmolLM2-135M is ~540 MB a step, bf16 / fp16 ~270 MB,
int8 ~135 MB, int4 ~70 MB. Each form multiplies activations by its own copy of
a weight with a library kernel; which form a call uses depends on its row
count (:func:`max_form_rows`, measured crossovers), and calls past every
form's limit use the dequantized reference (oneDNN / MKL).

Forms:

- ``int8``: symmetric per output channel, ``w[n, k] = q[n, k] * scale[n]``,
  ``q`` in [-127, 127]; ``aten._weight_int8pack_mm`` (bf16 activations).
- ``int4``: asymmetric in groups of 32 along the input dimension,
  ``w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`` with ``g = k // 32``
  and ``q`` in [0, 15] — the same form as GGUF's Q4_0 / Q4_1 / Q4_K blocks
  (``d * q + m`` per 32 weights), so a Q4_1 tensor requantized here recovers
  its own blocks up to the bf16 rounding of the scales;
  ``aten._weight_int4pack_mm_for_cpu`` (bf16 activations).
- ``q4_1`` and ``q8_0``: GGUF's block forms (32 weights a block along the
  input dimension: ``w = d * q + m``, ``q`` in [0, 15], or ``w = d * q``,
  ``q`` in [-127, 127]; fp16 ``d``, ``m``), multiplied by quanta's own C
  kernels (:mod:`quanta.model.native.forms`, ``qmatmul.c``) with the
  activations quantized per row and block of 32 to 8 bits (projections, as
  llama.cpp's Q8_1) or 15 bits (the LM head, ``fine``): integer dot products (AVX2 ``maddubs`` or AVX-512 VNNI ``dpbusd``)
  instead of the int4 kernel's dequantize-to-float. Available where the C
  library builds (x86-64 with AVX2 and a C compiler).
- ``fp16``: the reference weight stored in half precision, multiplied by
  FBGEMM's fp16 GEMM (``quantized.linear_dynamic_fp16``: fp32 activations
  and accumulation, weights widened with F16C). Not a quantization of the
  values that matter here: fp16 holds Q4_1 / Q8_0 block values to 11 bits,
  and the embedded model's logits move by at most ~0.03. On AVX2-only CPUs
  it beats MKL's fp32 at every row count measured (1-2,048: fp32 reads twice
  the bytes) and the int8/int4 kernels from 3-4 rows on (their AVX2 paths are
  compute-bound); see ``_MAX_ROWS``.

The int8 / int4 kernels are fast only with bf16 activations (their fp32 paths
are scalar, 10-30x slower), so fp32 activations are cast to bf16 around them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.model.native import forms as native_forms

#: weight forms a linear layer may hold besides its reference weight
#: forms multiplied by quanta's own C kernels (:mod:`quanta.model.native.forms`)
NATIVE_FORMS = ("q4_1", "q8_0")
FORMS = ("int8", "int4", "fp16", *NATIVE_FORMS)
INT4_GROUP = 32

#: Largest row count at which each form beat the next slower path, per
#: (form, reference is bf16); 0 = never faster, not attached. Whole decode
#: steps from ``benchmarks/quant_kernels.py`` (results in
#: ``benchmarks/results/quant_kernels_*.md``), 2-core AMD EPYC VMs: bf16
#: reference (AVX-512 + bf16, oneDNN packed), int4/int8 vs reference 17.2 vs
#: 27.5 ms at 1 row, 19.5 vs 29.4 at 4, 34.2 vs 28.7 at 8 (fp16 not measured
#: there: not attached); fp32 reference (AVX2 + FMA only), one thread, int4 /
#: fp16 / fp32 (int4 rows with an fp16 head) 56.2 / 65.8 / 113 ms at 1 row,
#: 60.7 / 72.0 / 199 at 2, 79.3 / 80.0 / 210 at 4, 123 / 128 / 232 at 8,
#: fp16 vs fp32 272 vs 379 at 32; int8 (80 ms at 1 row) never beat fp16.
#: Beyond 32 rows, an ad hoc loop over the 30 layers' projection shapes (cold
#: weights, 2 threads): fp16 vs fp32 244 vs 423 ms at 128 rows, 945 vs 1111 at
#: 512, 4251 vs 4593 at 2,048.
#: q4_1 / q8_0 (quanta's C kernels, with the native decode glue), fp32 with
#: AVX2 kernels forced, one thread (``results/quant_kernels_fp32_avx2_native.md``):
#: q4_1 projections with an fp16 head vs fp16 projections 12.5 / 16.2 ms at
#: 1 row, 22.8 / 24.1 at 4, 38.8 / 40.0 at 8, 72.9 / 69.5 at 16; the q8_0
#: head vs fp16 beside q4_1 8.5 / 12.5 at 1 row, 11.3 / 16.0 at 2, 26.6 /
#: 22.8 at 4. bf16 reference (``results/quant_kernels_bf16_native.md``): q4_1
#: vs the packed bf16 reference, both with a bf16 head, 10.4 / 27.2 ms at 1
#: row, 23.3 / 32.2 at 8, 37.0 / 48.2 at 16, 71.7 / 72.3 at 32; the q8_0 head
#: beside q4_1 8.2 / 10.4 at 1 row, 10.5 / 11.9 at 2, 17.5 / 15.7 at 4.
#: After the 256-bit tiles kept their sums in registers (2026-12-02), AVX2
#: forced, two threads, two runs: q4_1 vs fp16 projections (fp16 head) 13.3 /
#: 15.0 and 13.0 / 18.2 ms at 8 rows, 23.5 / 23.3 and 23.2 / 26.0 at 16, 37.3
#: / 40.2 and 43.6 / 49.6 at 32; the q8_0 head vs fp16 beside q4_1 11.9 / 13.3
#: and 11.8 / 13.0 at 8 rows, 21.7 / 23.5 and 22.3 / 23.2 at 16, 57.1 / 37.3
#: and 42.3 / 43.6 at 32; with the int16 Q8_0 kernel (q8_wide8), one run:
#: q8_0 vs fp16 head 11.7 / 11.4 ms at 8 rows, 26.2 / 22.0 at 16 (another, on a
#: slower hour: 14.2 / 16.0, 24.6 / 27.9), so the head stops at 8. (FBGEMM's fp16
#: GEMM still ran AVX-512 code there, so on an AVX2-only CPU these limits are,
#: if anything, low.)
_MAX_ROWS = {("int8", True): 4, ("int4", True): 4, ("fp16", True): 0,
             ("int8", False): 0, ("int4", False): 2, ("fp16", False): 2048,
             ("q4_1", True): 16, ("q4_1", False): 32, ("q8_0", True): 2, ("q8_0", False): 8}


def max_form_rows(form: str, bf16_reference: bool) -> int:
    """Row count up to which ``form`` is used (see ``_MAX_ROWS``; 0: never):
    the crossover against the next form, or a bf16 oneDNN-packed / fp32 MKL reference."""
    if form == "fp16" and not fp16_kernel_available():
        return 0
    return _MAX_ROWS[(form, bf16_reference)]


def fp16_kernel_available() -> bool:
    """Whether this torch build has FBGEMM's fp16 GEMM (x86 builds do)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


@dataclass
class QuantizedWeight:
    """A ``[N, K]`` weight in ``int8``, ``int4`` or ``fp16`` form; call it on ``[M, K]`` rows.

    Attributes:
        kind: ``int8``, ``int4``, ``fp16``, ``q4_1`` or ``q8_0``.
        data: int8 ``[N, K]``, the int4 kernel's packed layout, or FBGEMM's packed fp16 weight.
        scales: int8: bf16 ``[N]``; int4: bf16 ``[K / 32, N, 2]`` (scale, zero); q4_1: fp16
            ``[N / 8, K / 32, 2, 8]`` (d, m) with ``data`` uint8 ``[N / 8, K / 32, 128]``;
            q8_0: fp16 ``[N / 8, K / 32, 8]`` with int8 ``[N / 8, K / 32, 256]``
            (8 columns interleaved, see ``qmatmul.c``); fp16: empty.
        max_rows: the largest ``M`` the caller should send here.
    """

    kind: str
    data: torch.Tensor
    scales: torch.Tensor
    max_rows: int
    #: q4_1 / q8_0: 15-bit activations (else 8-bit; see :func:`quanta.model.native.forms.matmul`)
    fine: bool = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, K]`` -> ``[M, N]`` in ``x``'s dtype (int8/int4: computed with bf16 activations)."""
        if self.kind in NATIVE_FORMS:
            return native_forms.matmul(self.kind, x, self.data, self.scales, self.fine)
        if self.kind == "fp16":
            xf = x if x.dtype == torch.float32 else x.float()
            out = torch.ops.quantized.linear_dynamic_fp16(xf if xf.is_contiguous() else xf.contiguous(), self.data)
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        xb = x.to(torch.bfloat16) if x.dtype != torch.bfloat16 else x
        xb = xb if xb.is_contiguous() else xb.contiguous()
        if self.kind == "int8":
            out = torch.ops.aten._weight_int8pack_mm(xb, self.data, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.data, INT4_GROUP, self.scales)
        return out if x.dtype == torch.bfloat16 else out.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[N, K]`` weight this form represents (for tests and checks)."""
        if self.kind == "fp16":
            return torch.ops.quantized.linear_unpack_fp16(self.data)[0]  # the fp16 values, widened
        if self.kind == "int8":
            return self.data.float() * self.scales.float()[:, None]
        if self.kind in NATIVE_FORMS:
            return native_forms.dequantize(self.kind, self.data, self.scales)
        n = self.scales.shape[1]
        eye = torch.eye(self.scales.shape[0] * INT4_GROUP, dtype=torch.bfloat16)
        return self(eye).float().t().reshape(n, -1)


def quantize(weight: torch.Tensor, kind: str, max_rows: int, fine: bool = True) -> QuantizedWeight | None:
    """Quantize a ``[N, K]`` weight; None where the kernel cannot take it.

    int4 needs ``K`` divisible by 32 and ``N`` by 16 (the kernel's tiling);
    int8 and fp16 take any shape; q4_1 and q8_0 need ``N`` divisible by 8 and
    ``K`` by 32, and ``fine`` chooses their activations' precision (15 or 8
    bits). A kernel missing from this torch build (or C library) gives None.
    """
    w = weight.detach().float()
    try:
        if kind == "int8":
            return _int8(w, max_rows)
        if kind == "int4" and w.shape[1] % INT4_GROUP == 0 and w.shape[0] % 16 == 0:
            return _int4(w, max_rows)
        if kind in NATIVE_FORMS:
            data = native_forms.pack(w, kind)
            return None if data is None else QuantizedWeight(kind, data[0], data[1], max_rows, fine)
        if kind == "fp16" and fp16_kernel_available():
            packed = torch.ops.quantized.linear_prepack_fp16(w, None)
            return QuantizedWeight("fp16", packed, torch.empty(0), max_rows)
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
