"""A GGUF model built from the file's own blocks: every projection, the LM head and the embedding
table read tensor by tensor and converted straight into a C form (:mod:`quanta.model.native.repack`).

No float copy of a weight matrix is made: a tensor's bytes are mapped from the file (no copy; only
that tensor's pages, unmapped once it is converted), converted to its form, and dropped before the
next is mapped, so peak memory is the forms' size plus one tensor. Each projection computes
every row, prompt and generated, with its form's kernel (:attr:`PackedLinear.form_for_prompts`), so
a row's result depends neither on its role nor on the rows beside it.

Forms per GGUF type (:func:`quanta.model.native.repack.natural_kind`): Q4_0 / Q4_1 / Q4_K ->
``q4_1``; Q6_K -> ``q6_k`` (its own blocks); Q5_0 / Q5_1 / Q5_K / Q8_0 -> ``q8_0``; F16 / BF16 ->
``fp16``. A fused projection (q/k/v, gate/up) whose parts differ takes the widest part's form, and
``q8_0`` where a Q6_K part meets another type (Q4_K_M files keep ``attn_v`` in Q6_K: that layer's
q/k/v is ``q8_0``). The LM head takes ``q8_0`` (``q6_k`` from a Q6_K tensor, ``fp16`` from an F16
/ BF16 one) with 8-bit activations, as the projections (the dequantized path's head, from
:func:`quanta.launch.resolve_quantization`, takes 15-bit ones).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from torch import nn

from quanta.model import gguf_loader, gguf_plan, gguf_prefetch
from quanta.model.config import ModelConfig
from quanta.model.form_embedding import FormEmbedding
from quanta.model.gguf_expert_blocks import BLOCK_ARCHITECTURES, load_moe_block
from quanta.model.gguf_header import read_header
from quanta.model.llama import LlamaModel, PackedLinear
from quanta.model.moe import MoEBlock
from quanta.model.native import forms as native_forms
from quanta.model.native import repack
from quanta.model.quant import QuantizedWeight
from quanta.model.rope import RotaryEmbedding

#: GGUF tensor types held as plain float values (norms, biases, rope factors)
_FLOAT_TYPES = ("F32", "F16", "BF16")
#: files from this size on log their load's progress, a line at most every PROGRESS_EVERY_S seconds
PROGRESS_BYTES = 1 << 30
PROGRESS_EVERY_S = 2.0

log = logging.getLogger(__name__)


def unsupported_reason(cfg: ModelConfig, path: Path) -> str | None:
    """Why the file's blocks cannot be used directly (None: they can): a MoE of an architecture not
    in :data:`~quanta.model.gguf_expert_blocks.BLOCK_ARCHITECTURES`, a file with a float32 matrix
    (projection, embedding or head; a router is held as floats), or no C library here."""
    if cfg.num_experts and cfg.architecture not in BLOCK_ARCHITECTURES:
        return f"MoE experts of {cfg.architecture} (read from blocks: {', '.join(BLOCK_ARCHITECTURES)})"
    if not native_forms.available():
        return "no C kernels on this machine"
    if any(len(t.shape) == 2 and t.tensor_type.name == "F32" and not gguf_plan.ROUTER.search(t.name)
           for t in read_header(path).tensors):
        return "float32 matrices"
    return None


def check_types(path: Path) -> None:
    """Refuse a file with a tensor type quanta does not compute on, before anything large is allocated.

    Raises:
        ValueError: one line naming the first such tensor, its type and the supported types.
    """
    for name, kind in gguf_loader.gguf_tensor_types(path).items():
        if kind not in repack.SUPPORTED and kind not in _FLOAT_TYPES:
            raise ValueError(f"{path.name}: tensor {name} has type {kind}; quanta computes on "
                             f"{', '.join(sorted(repack.SUPPORTED | set(_FLOAT_TYPES)))}")


class _File:
    """The tensors of one GGUF file by name; raw bytes mapped on demand; forms taken from ``prefetch``
    where it converted them ahead (:mod:`quanta.model.gguf_prefetch`)."""

    def __init__(self, path: Path, cfg: ModelConfig, prefetch: gguf_prefetch.Prefetch | None = None) -> None:
        self.path, self.cfg, self.prefetch = path, cfg, prefetch
        self.tensors = {t.name: t for t in read_header(path).tensors}
        self.permuted = cfg.architecture == "llama"  # dense llama: llama.cpp's q/k row order

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes in the file's pages (:func:`quanta.model.gguf_plan.mapped`): no copy."""
        return gguf_plan.mapped(self.path, self.tensors[name])

    def mapped_f16(self, name: str) -> torch.Tensor:
        """An F16 tensor as the fp16 form's ``[N, K]`` matrix in the file's own pages: no copy and no
        fresh memory (a copy of a 2.3 GB F16 file took seconds of page faults), shared with the page
        cache as llama-server maps its weights. Read-only: a form is never written once loaded."""
        n, k = self.shape(name)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(self.raw(name).view(np.float16).reshape(n, k))

    def shape(self, name: str) -> tuple[int, int]:
        """``(N, K)``: output rows, input columns."""
        return gguf_plan.shape(self.tensors[name])

    def kind(self, name: str) -> str:
        try:
            return gguf_plan.natural(self.tensors[name])
        except ValueError as exc:
            raise ValueError(f"{self.path.name}: {exc}") from exc

    def floats(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A small tensor (norm, bias) dequantized, in ``dtype``."""
        return torch.from_numpy(gguf_loader._dequantize(self.tensors[name])).to(dtype)

    def rows(self, name: str) -> np.ndarray | None:
        """The row map that undoes llama.cpp's q/k row order for the ``llama`` architecture, else None."""
        if not self.permuted:
            return None
        return gguf_plan.row_map(name, self.shape(name)[0], self.cfg.num_attention_heads, self.cfg.num_key_value_heads)

    def widest(self, names: list[str]) -> str:
        """The kind of a form stacked from ``names`` (:func:`quanta.model.gguf_plan.widest`)."""
        return gguf_plan.widest({self.kind(n) for n in names})

    def form(self, names: list[str], kind: str | None = None, fine: bool = False) -> QuantizedWeight:
        """The tensors ``names`` stacked along their output rows, in ``kind`` (default: the widest
        part's natural form), read and converted one at a time; a lone F16 tensor in its file order
        is its mapped pages (:meth:`mapped_f16`); a form the prefetch converted is taken from it."""
        kind = kind or self.widest(names)
        if gguf_plan.is_mapped_f16(self.tensors, names, kind, self.permuted):
            return QuantizedWeight(kind, self.mapped_f16(names[0]), torch.empty(0), fine)
        rows = [self.rows(n) for n in names]
        if self.prefetch is not None and (done := self.prefetch.take(names, kind, rows)) is not None:
            return QuantizedWeight(kind, torch.from_numpy(done[0]), torch.from_numpy(done[1]), fine)
        k = self.shape(names[0])[1]
        whole = QuantizedWeight(kind, *repack.empty_form(kind, sum(self.shape(n)[0] for n in names), k), fine)
        start = 0
        for name, row_map in zip(names, rows, strict=True):
            n = self.shape(name)[0]
            part = whole.part(start, start + n)
            repack.to_form(self.raw(name), self.tensors[name].tensor_type.name, n, k, kind, row_map,
                           out=(part.data, part.scales))
            start += n
        return whole


def load_block_model(path: Path, cfg: ModelConfig, dtype: torch.dtype) -> LlamaModel:
    """The dense model of GGUF file ``path`` with its projections, LM head and embedding table in
    forms made from the file's blocks; activations and norms in ``dtype``.

    Raises:
        ValueError: a tensor type without a C form, a shape a form cannot take, a truncated tensor.
    """
    check_types(path)
    prefetch = gguf_prefetch.claim(path)
    try:
        return _build(_File(path, cfg, prefetch), cfg, dtype)
    finally:
        if prefetch is not None:
            prefetch.close()


def _build(file: _File, cfg: ModelConfig, dtype: torch.dtype) -> LlamaModel:
    path = file.path
    with _shapes_only():
        model = LlamaModel(cfg)
    model.rope = RotaryEmbedding(cfg)
    counts: dict[str, int] = {}
    progress = _Progress(path, len(model.layers))
    for i, layer in enumerate(model.layers):
        _load_layer(file, layer, f"blk.{i}.", dtype, counts)
        progress.layer_done(i + 1)
    model.norm.weight = nn.Parameter(file.floats("output_norm.weight", dtype), requires_grad=False)
    head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    head_kind = gguf_plan.head_kind(file.tensors[head])
    progress.tensor(file, head, "LM head and embedding" if cfg.tie_word_embeddings else "LM head")
    # 8-bit activations per block of 32, as the projections (llama.cpp quantizes a Q6_K head's rows
    # to 8 bits per 256): 15-bit ones are two integer dot products a block, ~15% of an 8-row step
    head_form = file.form([head], head_kind)
    if cfg.tie_word_embeddings:
        model._tied_head_form = head_form
        model.embed_tokens = FormEmbedding(head_form, dtype)
    else:
        model.lm_head = _form_linear(head_form)
        progress.tensor(file, "token_embd.weight", "embedding")
        model.embed_tokens = FormEmbedding(file.form(["token_embd.weight"]), dtype)
    counts[head_kind] = counts.get(head_kind, 0) + 1
    model.quantized, model.weight_forms = counts, ("blocks", head_kind)
    return model.eval()


class _Progress:
    """Log lines ``loading NAME: 12 of 28 layers (43%), 2.1 s`` while a file of
    :data:`PROGRESS_BYTES` or more loads, at most one every :data:`PROGRESS_EVERY_S` seconds, and
    one as the LM head and the embedding start, single tensors that take seconds on a large file
    (the 8B Llama 3.1 Q4_K_M's 128,256 x 4,096 Q6_K head 2.2 s, its Q4_K embedding 1.2 s, 2 AVX2 cores)."""

    def __init__(self, path: Path, layers: int) -> None:
        self.name, self.layers = path.name, layers
        self.on = path.stat().st_size >= PROGRESS_BYTES
        self.start = self.last = time.monotonic()

    def layer_done(self, done: int) -> None:
        now = time.monotonic()
        if self.on and done < self.layers and now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            log.info("loading %s: %d of %d layers (%d%%), %.1f s", self.name, done, self.layers,
                     100 * done // self.layers, now - self.start)

    def tensor(self, file: _File, name: str, role: str) -> None:
        """The line before ``name`` (the ``role``: LM head, embedding) is read and converted."""
        if self.on:
            (n, k), kind = file.shape(name), file.tensors[name].tensor_type.name
            log.info("loading %s: %d of %d layers, %.1f s; converting the %s (%s, %d x %d %s)", self.name,
                     self.layers, self.layers, time.monotonic() - self.start, role, name, n, k, kind)


@contextlib.contextmanager
def _shapes_only() -> Iterator[None]:
    """Modules built inside hold meta tensors (shapes, no memory) and skip their random
    initialisation and RoPE tables (any computation on meta tensors costs ~1.2 s of one-time imports)."""
    with (torch.device("meta"), mock.patch.object(nn.Linear, "reset_parameters", lambda self: None),
          mock.patch.object(nn.Embedding, "reset_parameters", lambda self: None),
          mock.patch("quanta.model.llama.RotaryEmbedding", lambda cfg: None)):
        yield


def _load_layer(file: _File, layer, prefix: str, dtype: torch.dtype, counts: dict[str, int]) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    norms = [(layer.input_layernorm, "attn_norm"), (layer.post_attention_layernorm, "ffn_norm")]
    if attn.q_norm is not None:
        norms += [(attn.q_norm, "attn_q_norm"), (attn.k_norm, "attn_k_norm")]
    norms += getattr(layer, "gguf_norms", list)()  # Gemma's post-attention and post-MLP norms
    for norm, stem in norms:
        norm.weight = nn.Parameter(file.floats(f"{prefix}{stem}.weight", dtype), requires_grad=False)
    parts = gguf_plan.projections(file.tensors, prefix)
    bias = [n.removesuffix(".weight") + ".bias" for n in parts["qkv_proj"]] if attn.qkv_proj.bias is not None else None
    fused = {"qkv_proj": (attn, parts["qkv_proj"], bias), "o_proj": (attn, parts["o_proj"], None)}
    if isinstance(mlp, MoEBlock):
        load_moe_block(file, mlp, prefix, dtype, counts, _form_linear)
    else:  # phi3: one attn_qkv (q, k, v rows), and ffn_up holding the gate rows, then the up rows
        fused["gate_up_proj"] = (mlp, parts["gate_up_proj"], None)
        fused["down_proj"] = (mlp, parts["down_proj"], None)
    for attr, (owner, names, bias_names) in fused.items():
        form = file.form(names)
        counts[form.kind] = counts.get(form.kind, 0) + 1
        bias_tensor = None if bias_names is None else torch.cat([file.floats(b, dtype) for b in bias_names])
        setattr(owner, attr, _form_linear(form, bias_tensor))


def _form_linear(form: QuantizedWeight, bias: torch.Tensor | None = None) -> PackedLinear:
    """A linear layer that holds only ``form`` (and ``bias``) and computes every row with it."""
    n, k = form.shape
    with _shapes_only():
        lin = PackedLinear(k, n, bias=False)
    del lin.weight
    lin.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    lin.form, lin.form_for_prompts = form, True
    return lin
