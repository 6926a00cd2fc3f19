"""Decode forms of the weights: int8, int4, fp16, q4_1 and q8_0 copies.

A decode step reads every weight once for a handful of rows, so its cost is
the bytes it reads: fp32 SmolLM2-135M is ~540 MB a step, bf16 / fp16 ~270 MB,
int8 ~135 MB, int4 ~70 MB. A linear layer may hold one of these forms beside
its reference weight. Which one a call uses depends on the role of its rows,
never on how many there are (:func:`quanta.model.linear.linear`): rows of
generated tokens (decode) take the form at every batch size, prompt rows
(prefill chunks, whatever their size) take the reference. Each kernel
computes a row independently of the rows beside it, so a token's logits do
not depend on what else is batched, on chunking, or on a prefix-cache hit.

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
- ``fp16``: the reference weight stored in half precision (``[N, K]``, one
  copy), multiplied in float32 (weights widened with F16C, fp32 activations
  and sums) by quanta's own C kernel (``f16matmul.c``,
  :func:`quanta.model.native.forms.f16_matmul`) where the C library builds,
  else by FBGEMM's fp16 GEMM (``quantized.linear_dynamic_fp16``, its weight
  packed). Only the C kernel computes a row the same in a call of any size:
  FBGEMM picks its micro-kernel by the call's row count (6-row tiles and
  remainders on AVX2), which moves a row's result by ~5e-7. The C kernel is
  also the faster at 1-8 rows on the embedded model's shapes (1.1-1.8x on
  an AVX2 Zen 3, weights read from memory; one-row LM head on two threads
  even; the table in ``f16matmul.c``). Not a
  quantization of the values that matter here: fp16 holds Q4_1 / Q8_0 block
  values to 11 bits, and the embedded model's logits move by at most ~0.03.
  On AVX2-only CPUs FBGEMM's fp16 beat MKL's fp32 at every row count
  measured (1-2,048: fp32 reads twice the bytes); beside a bf16 reference it
  saves nothing and is not attached.

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
#: forms the C block kernels multiply (``qmatmul.c``): NATIVE_FORMS, which quanta also packs from a float
#: weight, and ``q6_k``, converted from a GGUF's own Q6_K blocks only
BLOCK_FORMS = (*NATIVE_FORMS, "q6_k")
FORMS = ("int8", "int4", "fp16", *NATIVE_FORMS)
INT4_GROUP = 32


def fp16_kernel_available() -> bool:
    """Whether an fp16 form can be multiplied here: by quanta's C kernel where the C library
    loads, else by FBGEMM's fp16 GEMM where this torch build has it (x86 builds do)."""
    return native_forms.available() or "fbgemm" in torch.backends.quantized.supported_engines


@dataclass
class QuantizedWeight:
    """A ``[N, K]`` weight in ``int8``, ``int4`` or ``fp16`` form; call it on ``[M, K]`` rows.

    Attributes:
        kind: ``int8``, ``int4``, ``fp16``, ``q4_1``, ``q8_0`` or ``q6_k``.
        data: int8 ``[N, K]``, the int4 kernel's packed layout, or for fp16 the fp16 ``[N, K]``
            weight (quanta's C kernel) or, where the C library does not load, FBGEMM's packed one.
        scales: int8: bf16 ``[N]``; int4: bf16 ``[K / 32, N, 2]`` (scale, zero); q4_1: fp16
            ``[N / 8, K / 32, 2, 8]`` (d, m) with ``data`` uint8 ``[N / 8, K / 32, 128]``;
            q8_0: fp16 ``[N / 8, K / 32, 8]`` with int8 ``[N / 8, K / 32, 256]``; q6_k: fp16
            ``[N / 8, K / 256, 8]`` with uint8 ``[N / 8, K / 32, 208]`` (8 columns interleaved,
            see ``qmatmul.c``); fp16: empty.
    """

    kind: str
    data: torch.Tensor
    scales: torch.Tensor
    #: q4_1 / q8_0: 15-bit activations (else 8-bit; see :func:`quanta.model.native.forms.matmul`)
    fine: bool = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, K]`` -> ``[M, N]`` in ``x``'s dtype (int8/int4: computed with bf16 activations)."""
        if self.kind in BLOCK_FORMS:
            return native_forms.matmul(self.kind, x, self.data, self.scales, self.fine)
        if self.kind == "fp16" and self.c_kernel:
            return native_forms.f16_matmul(x, self.data)
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

    def part(self, start: int, end: int) -> QuantizedWeight:
        """Output rows ``[start, end)`` of a form quanta's C kernels multiply, as a view (no copy):
        one expert of a form holding every expert's rows. q4_1 / q8_0 take multiples of 8."""
        if not self.c_kernel:
            raise ValueError(f"a {self.kind} form held for FBGEMM has no row views")
        if self.kind == "fp16":
            return QuantizedWeight(self.kind, self.data[start:end], self.scales, self.fine)
        if start % 8 or end % 8:
            raise ValueError(f"rows [{start}, {end}) of a {self.kind} form must be multiples of 8")
        return QuantizedWeight(self.kind, self.data[start // 8:end // 8], self.scales[start // 8:end // 8], self.fine)

    def experts(self, x: torch.Tensor, n: int, groups: list[tuple[int, int]]) -> torch.Tensor:
        """Routed experts (a q4_1 / q8_0 form of every expert's ``n`` rows in turn): ``groups`` of
        ``(expert, rows)`` in ``x``'s row order, each group's rows times its expert's rows, in one C
        call (:func:`quanta.model.native.forms.matmul_experts`); each row as its expert's
        :meth:`part` computes it."""
        return native_forms.matmul_experts(self.kind, x, self.data, self.scales, self.fine, n, groups)

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the weight this form holds."""
        if self.kind in BLOCK_FORMS:
            return self.data.shape[0] * 8, self.data.shape[1] * native_forms.BLOCK
        if self.kind == "fp16" and self.c_kernel:
            return tuple(self.data.shape)
        return tuple(self.dequantize().shape)

    @property
    def native(self) -> bool:
        """Whether quanta's C block kernels multiply this form (q4_1 / q8_0 / q6_k)."""
        return self.kind in BLOCK_FORMS

    @property
    def c_kernel(self) -> bool:
        """Whether quanta's C kernels multiply this form: q4_1 / q8_0, and fp16 held as its plain
        fp16 weight (not FBGEMM's packed one, where the C library did not load)."""
        return self.native or (self.kind == "fp16" and isinstance(self.data, torch.Tensor))

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The ``[N, K]`` weight this form represents, in ``dtype`` (bf16 or float32): rebuilt by
        the C library for q4_1 / q8_0 (:func:`quanta.model.native.forms.dense`), else converted
        from :meth:`dequantize`."""
        if self.native:
            return native_forms.dense(self.kind, self.data, self.scales, dtype)
        return self.dequantize().to(dtype)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[N, K]`` weight this form represents (for tests and checks)."""
        if self.kind == "fp16" and self.c_kernel:
            return self.data.float()
        if self.kind == "fp16":
            return torch.ops.quantized.linear_unpack_fp16(self.data)[0]  # the fp16 values, widened
        if self.kind == "int8":
            return self.data.float() * self.scales.float()[:, None]
        if self.kind in BLOCK_FORMS:
            return native_forms.dequantize(self.kind, self.data, self.scales)
        n = self.scales.shape[1]
        eye = torch.eye(self.scales.shape[0] * INT4_GROUP, dtype=torch.bfloat16)
        return self(eye).float().t().reshape(n, -1)


def quantize(weight: torch.Tensor, kind: str, fine: bool = True) -> QuantizedWeight | None:
    """Quantize a ``[N, K]`` weight; None where the kernel cannot take it.

    int4 needs ``K`` divisible by 32 and ``N`` by 16 (the kernel's tiling);
    int8 and fp16 take any shape; q4_1 and q8_0 need ``N`` divisible by 8 and
    ``K`` by 32, and ``fine`` chooses their activations' precision (15 or 8
    bits). A kernel missing from this torch build (or C library) gives None.
    """
    w = weight.detach().float()
    try:
        if kind == "int8":
            return _int8(w)
        if kind == "int4" and w.shape[1] % INT4_GROUP == 0 and w.shape[0] % 16 == 0:
            return _int4(w)
        if kind in NATIVE_FORMS:
            data = native_forms.pack(w, kind)
            return None if data is None else QuantizedWeight(kind, data[0], data[1], fine)
        if kind == "fp16" and native_forms.available():
            return QuantizedWeight("fp16", w.half().contiguous(), torch.empty(0))
        if kind == "fp16" and fp16_kernel_available():
            packed = torch.ops.quantized.linear_prepack_fp16(w, None)
            return QuantizedWeight("fp16", packed, torch.empty(0))
    except (RuntimeError, AttributeError):
        return None
    return None


def _int8(w: torch.Tensor) -> QuantizedWeight:
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    qw = QuantizedWeight("int8", q, scales.to(torch.bfloat16))
    torch.ops.aten._weight_int8pack_mm(torch.zeros(1, w.shape[1], dtype=torch.bfloat16), q, qw.scales)  # kernel exists
    return qw


def _int4(w: torch.Tensor) -> QuantizedWeight:
    n, k = w.shape
    groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((groups - lo) / scale).clamp(0, 15).to(torch.int32).view(n, k)
    zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
    scale_zero = torch.stack([scale.view(n, -1).t(), zero.view(n, -1).t()], dim=-1).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    return QuantizedWeight("int4", packed, scale_zero.to(torch.bfloat16))
