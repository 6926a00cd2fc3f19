"""Linear layers: the reference weight pre-packed for oneDNN, plus an optional decode form.

``F.linear`` reorders a bf16 weight into oneDNN's blocked layout at each
call; packing once (``torch.ops.mkldnn._reorder_linear_weight``, the op
PyTorch's inductor uses for CPU linears) removes that work. Measured on the
2-core dev machine (AMD EPYC, avx512_bf16), 30 layers of SmolLM2's projections:
24.9 -> 12.9 ms at 1 row, 40.6 -> 24.7 ms at 32 rows, 1342 -> 1030 ms at
2000 rows. fp32 weights are packed the same way: oneDNN's fp32 GEMM computes
each row the same whatever the row count and thread count (MKL's, behind
``F.linear``, does not below ~6 rows a thread), and is as fast or faster from
8 rows on.

Batch invariance: a call's kernel depends on the role of its rows, not on how
many there are. Decode rows (generated tokens) take the layer's
:class:`~quanta.model.quant.QuantizedWeight` form when it has one; prompt rows
take the packed reference. oneDNN takes a one-row call down another path, so
one row is padded to two. ``tests/test_batch_invariance.py`` checks every
kernel row by row against larger calls.

Without a reference (``--prompt-weights form``, :meth:`PackedLinear.drop_reference`), a layer
with a C form (q4_1 / q8_0) keeps only that form; each prompt call rebuilds the weight from it
(:meth:`~quanta.model.quant.QuantizedWeight.dense`, one pass over the weight) and multiplies as
a reference would: bf16 through ``F.linear`` (oneDNN, the packed kernel's bits at every row
count), float32 through a freshly packed weight (MKL's ``F.linear`` is not row-invariant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quanta.model.quant import QuantizedWeight

#: dtypes whose reference weight oneDNN packs
PACKED_DTYPES = (torch.bfloat16, torch.float32)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed weight, or None where oneDNN cannot pack it or disagrees with F.linear."""
    if weight.dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        probe = torch.randn(3, weight.shape[1], dtype=weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return None
    if not torch.allclose(got.float(), F.linear(probe, weight).float(), atol=1e-2, rtol=1e-2):
        return None
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, packed: torch.Tensor | None,
           form: QuantizedWeight | None = None, decode: bool = False, form_for_prompts: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[T, in]``: decode rows through ``form`` when
    there is one (prompt rows too with ``form_for_prompts``), prompt rows (and decode rows
    without a form) through the packed weight when there is one, else ``F.linear``."""
    if form is not None and (decode or form_for_prompts):
        out = form(x)
        return out if bias is None else out + bias
    if weight is None and packed is None and form is not None:  # no reference kept: rebuilt from the form
        weight = form.dense(x.dtype)
        if weight.dtype == torch.float32:
            weight, packed = None, torch.ops.mkldnn._reorder_linear_weight(weight)
    if packed is None:
        return F.linear(x, weight, bias)
    if x.shape[0] == 1:  # oneDNN's one-row path sums in another order
        return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), packed, bias, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """``nn.Linear`` plus :meth:`pack`; ``forward`` takes ``[T, in]`` and returns ``[T, out]``."""

    packed: torch.Tensor | None = None
    form: QuantizedWeight | None = None
    #: prompt rows computed by :attr:`form` too (a layer built from a GGUF's blocks,
    #: :mod:`quanta.model.gguf_blocks`, holds nothing else)
    form_for_prompts: bool = False
    #: the dtype of the reference weight (what ``weight`` reads after :meth:`drop_reference`)
    reference_dtype: torch.dtype = torch.float32

    def pack(self) -> bool:
        """Pack the current weight (call after loading and dtype conversion); True if packed."""
        self.packed = pack_weight(self.weight.detach())
        return self.packed is not None

    def drop_plain_weight(self) -> bool:
        """Free the plain weight where the packed one holds it (True if freed): the packed
        copy is the same values in oneDNN's layout, and reading ``weight`` afterwards
        rebuilds the plain tensor from it, exactly (a copy, for the rare reader)."""
        if self.packed is None or "weight" not in self._parameters:
            return False
        del self.weight
        return True

    def drop_reference(self) -> bool:
        """Free the reference weight, plain and packed, where a C form (q4_1 / q8_0) holds it
        (True if freed): prompt rows are then multiplied by the weight rebuilt from the form at
        each call, and ``weight`` reads that rebuilt weight."""
        if self.form is None or not self.form.native:
            return False
        self.reference_dtype = (self.packed if self.packed is not None else self.weight).dtype
        self.packed = None
        if "weight" in self._parameters:
            del self.weight
        return True

    def __getattr__(self, name: str):
        if name == "weight":
            packed, form = self.__dict__.get("packed"), self.__dict__.get("form")
            if packed is not None:
                return packed.to_dense()
            if form is not None and form.native:
                return form.dense(self.reference_dtype)
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor, decode: bool = False) -> torch.Tensor:
        weight = self._parameters.get("weight") if self.packed is None else None  # else the packed one
        return linear(x, weight, self.bias, self.packed, self.form, decode, self.form_for_prompts)
