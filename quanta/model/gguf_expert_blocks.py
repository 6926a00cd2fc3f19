"""A GGUF MoE block's weights from the file's own blocks: the router and its bias as floats, the
routed experts' 3-D tensors (``ffn_{gate,up,down}_exps``, ``[E, rows, K]``) converted expert by
expert into one C form per projection, and the shared expert's projections as forms.

An expert's rows are a contiguous slice of its 3-D tensor, so each is converted straight from the
file's pages into its place in the form (:func:`quanta.model.native.repack.to_form` on the slice):
gate then up rows of expert ``e`` at ``e * 2I`` of the gate/up form, its down rows at ``e * H`` of
the down form. Gate and up take the wider of their two types' forms, as a dense layer's fused
gate/up does (:mod:`quanta.model.gguf_blocks`). No float copy of an expert is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from quanta.model.moe import MoEBlock
from quanta.model.native import repack
from quanta.model.quant import QuantizedWeight


class _File(Protocol):
    """What is read here of a GGUF file (:class:`quanta.model.gguf_blocks._File`)."""

    path: Path
    tensors: dict[str, Any]

    def raw(self, name: str) -> np.ndarray: ...
    def floats(self, name: str, dtype: torch.dtype) -> torch.Tensor: ...
    def form(self, names: list[str]) -> QuantizedWeight: ...
    def widest(self, names: list[str]) -> str: ...


#: MoE architectures whose blocks path is checked against llama.cpp (tests/test_agreement_llama_cpp.py)
#: and against the dequantized file (tests/test_gguf_expert_blocks.py); others take the dequantizing loader.
BLOCK_ARCHITECTURES = ("qwen3_moe",)


def load_moe_block(file: _File, mlp: MoEBlock, prefix: str, dtype: torch.dtype, counts: dict[str, int],
                   form_linear) -> None:
    """Fill ``mlp`` (built with meta tensors) from the tensors ``prefix`` + stem of ``file``;
    ``counts`` gains each form's kind, ``form_linear`` makes the shared expert's linears."""
    # the router stays float32 (as the file holds it), multiplied row by row the same (Router.logits)
    mlp.gate.weight = nn.Parameter(file.floats(f"{prefix}ffn_gate_inp.weight", torch.float32), requires_grad=False)
    if mlp.gate.scoring == "sigmoid":
        mlp.gate.e_score_correction_bias = nn.Parameter(file.floats(f"{prefix}exp_probs_b.bias", torch.float32),
                                                        requires_grad=False)
    gate_up = expert_form(file, [f"{prefix}ffn_gate_exps.weight", f"{prefix}ffn_up_exps.weight"])
    down = expert_form(file, [f"{prefix}ffn_down_exps.weight"])
    mlp.experts.use_forms(gate_up, down)
    for form in (gate_up, down):
        counts[form.kind] = counts.get(form.kind, 0) + 1
    if mlp.shared_expert is not None:
        shared = mlp.shared_expert
        for attr, names in (("gate_up_proj", ["ffn_gate_shexp", "ffn_up_shexp"]), ("down_proj", ["ffn_down_shexp"])):
            form = file.form([f"{prefix}{n}.weight" for n in names])
            counts[form.kind] = counts.get(form.kind, 0) + 1
            setattr(shared, attr, form_linear(form))
    if mlp.shared_expert_gate is not None:
        weight = file.floats(f"{prefix}ffn_gate_inp_shexp.weight", dtype).reshape(1, -1)
        mlp.shared_expert_gate.weight = nn.Parameter(weight, requires_grad=False)


def expert_shape(file: _File, name: str) -> tuple[int, int, int]:
    """``(E, N, K)`` of a 3-D expert tensor: experts, output rows, input columns (ggml lists them reversed)."""
    k, n, e = (int(d) for d in file.tensors[name].shape)
    return e, n, k


def expert_form(file: _File, names: list[str]) -> QuantizedWeight:
    """The experts of the 3-D tensors ``names`` (same E and K) in one form: expert ``e``'s rows of
    each tensor in turn at ``e * (sum of their N)``; the widest part's natural form."""
    kind = file.widest(names)
    shapes = [expert_shape(file, n) for n in names]
    experts, k = shapes[0][0], shapes[0][2]
    if any(s[0] != experts or s[2] != k for s in shapes):
        raise ValueError(f"{file.path.name}: expert tensors {names} differ in experts or columns: {shapes}")
    width = sum(s[1] for s in shapes)
    whole = QuantizedWeight(kind, *repack.empty_form(kind, experts * width, k), fine=False)
    offset = 0  # the tensor's rows within an expert's
    for name, (_, n, _) in zip(names, shapes):
        ggml_type = file.tensors[name].tensor_type.name
        raw, size = file.raw(name), n * repack.row_bytes(ggml_type, k)
        for e in range(experts):
            part = whole.part(e * width + offset, e * width + offset + n)
            repack.to_form(raw[e * size:(e + 1) * size], ggml_type, n, k, kind, out=(part.data, part.scales))
        offset += n
    return whole
