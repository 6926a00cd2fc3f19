"""Linear layers: bf16 weights pre-packed for oneDNN, plus an optional quantized form.

``F.linear`` on bf16 reorders the weight into oneDNN's blocked layout at each
call; packing once (``torch.ops.mkldnn._reorder_linear_weight``, the op
PyTorch's inductor uses for CPU linears) removes that work. Measured on the
2-core dev machine (AMD EPYC, avx512_bf16), 30 layers of SmolLM2's projections:
24.9 -> 12.9 ms at 1 row, 40.6 -> 24.7 ms at 32 rows, 1342 -> 1030 ms at
2000 rows. fp32 keeps ``F.linear`` (MKL, no reorder).

With :class:`~quanta.model.quant.QuantizedWeight` forms attached (sorted by
``max_rows``), a call uses the first form whose ``max_rows`` covers its row
count (decode steps: int4 / int8; on fp32 CPUs fp16 up to prefill-sized
chunks); larger calls use the reference weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quanta.model.quant import QuantizedWeight


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed weight, or None where oneDNN cannot pack it or disagrees with F.linear."""
    if weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None,
           forms: tuple[QuantizedWeight, ...] = ()) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[T, in]``: the first of ``forms``
    (ascending ``max_rows``) that takes ``T`` rows, else the packed weight when
    there is one, else ``F.linear``."""
    rows = x.shape[0]
    for form in forms:
        if rows <= form.max_rows:
            out = form(x)
            return out if bias is None else out + bias
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """``nn.Linear`` plus :meth:`pack`; ``forward`` takes ``[T, in]`` and returns ``[T, out]``."""

    packed: torch.Tensor | None = None
    forms: tuple[QuantizedWeight, ...] = ()

    def pack(self) -> bool:
        """Pack the current weight (call after loading and dtype conversion); True if packed."""
        self.packed = pack_weight(self.weight.detach())
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.forms)

