"""Which C form each weight of a GGUF file is loaded into, from the file's header alone.

:mod:`quanta.model.gguf_blocks` builds a model from these decisions, and
:mod:`quanta.model.gguf_prefetch` converts a dense file's forms ahead of it, before torch is
imported: this module imports no torch.

- A layer's projections (:func:`projections`): q/k/v stacked (or phi3's one ``attn_qkv``), the
  output, gate/up stacked (or phi3's one ``ffn_up`` holding both), down.
- A form's kind (:func:`widest`): the widest of its parts' natural kinds
  (:func:`quanta.model.native.repack.natural_kind`), ``q8_0`` where a Q6_K part meets another type.
- The LM head (:func:`head_kind`): its own ``fp16`` / ``q6_k``, else ``q8_0``.
- llama.cpp stores the ``llama`` architecture's q and k rows permuted (:func:`row_map` undoes it).
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quanta.model.gguf_header import GGUFHeader, GGUFTensorInfo
from quanta.model.native import repack

#: form kinds from narrowest to widest (a fused projection takes its widest part's; q6_k, converted
#: from Q6_K alone, only where every part is Q6_K: beside another type it takes q8_0)
WIDTH = {"q4_1": 0, "q6_k": 1, "q8_0": 2, "fp16": 3}
#: MoE routers, float32 in llama.cpp's files and held as floats
ROUTER = re.compile(r"\.ffn_gate_inp(_shexp)?\.weight$")


def asks_for_blocks(path: str | Path | None, quantization: str, prompt_weights: str) -> bool:
    """Whether a load of ``path`` with these settings reads a GGUF from its blocks where the file allows:
    a ``.gguf`` file, ``--quantization auto`` and ``--prompt-weights`` ``auto`` or ``blocks``."""
    return (prompt_weights in ("auto", "blocks") and quantization == "auto" and path is not None
            and Path(path).suffix == ".gguf" and Path(path).is_file())


def projections(tensors: Container[str], prefix: str) -> dict[str, list[str]]:
    """A dense layer's projections (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``), each the
    file's tensors stacked along their output rows into it; ``prefix``: ``blk.3.``."""
    qkv = ["attn_qkv"] if f"{prefix}attn_qkv.weight" in tensors else ["attn_q", "attn_k", "attn_v"]
    gate_up = ["ffn_gate", "ffn_up"] if f"{prefix}ffn_gate.weight" in tensors else ["ffn_up"]
    return {"qkv_proj": [f"{prefix}{p}.weight" for p in qkv], "o_proj": [f"{prefix}attn_output.weight"],
            "gate_up_proj": [f"{prefix}{p}.weight" for p in gate_up], "down_proj": [f"{prefix}ffn_down.weight"]}


def natural(tensor: GGUFTensorInfo) -> str:
    """The form ``tensor``'s type converts to by default.

    Raises:
        ValueError: a type with no C form."""
    kind = repack.natural_kind(tensor.tensor_type.name)
    if kind is None:
        raise ValueError(f"tensor {tensor.name} of type {tensor.tensor_type.name} has no C form")
    return kind


def widest(kinds: set[str]) -> str:
    """The kind a form stacked from parts of natural ``kinds`` takes (module docstring)."""
    if "q6_k" in kinds and len(kinds) > 1:
        kinds = kinds - {"q6_k"} | {"q8_0"}
    return max(kinds, key=WIDTH.__getitem__)


def head_kind(tensor: GGUFTensorInfo) -> str:
    """The LM head's kind: its own where that is ``fp16`` or ``q6_k``, else ``q8_0``."""
    kind = natural(tensor)
    return kind if kind in ("fp16", "q6_k") else "q8_0"


def shape(tensor: GGUFTensorInfo) -> tuple[int, int]:
    """``(N, K)``: output rows, input columns (ggml lists the input dimension first)."""
    k, n = (int(d) for d in tensor.shape)
    return n, k


def reordered(name: str) -> bool:
    """Whether llama.cpp writes tensor ``name``'s rows permuted in a ``llama`` architecture file (q and k)."""
    return re.search(r"\.attn_[qk]\.", name) is not None


def row_map(name: str, n: int, n_head: int, n_kv_head: int) -> np.ndarray | None:
    """The row map that undoes llama.cpp's q/k row order of the ``llama`` architecture's tensor ``name``
    (``n`` rows), None for a tensor in its file order."""
    if not reordered(name):
        return None
    heads = n_head if ".attn_q." in name else n_kv_head
    half = n // heads // 2
    h, a, b = np.meshgrid(np.arange(heads), np.arange(2), np.arange(half), indexing="ij")
    return (h * 2 * half + 2 * b + a).reshape(-1).astype(np.int32)


def mapped(path: Path, tensor: GGUFTensorInfo) -> np.ndarray:
    """The tensor's bytes in the file's pages, mapped (and read ahead) for as long as the array lives: no
    copy. The header's reader has checked that they are in the file."""
    start, size = int(tensor.data_offset), int(tensor.n_bytes)
    skip = start % mmap.ALLOCATIONGRANULARITY  # a mapping starts at a multiple of it
    with open(path, "rb") as f:
        pages = mmap.mmap(f.fileno(), skip + size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                          prot=mmap.PROT_READ, offset=start - skip)
    return np.frombuffer(pages, dtype=np.uint8, count=size, offset=skip)


def is_mapped_f16(tensors: dict[str, GGUFTensorInfo], names: list[str], kind: str, permuted: bool) -> bool:
    """A form that is the file's own pages, not converted: one F16 tensor in its file order."""
    return (kind == "fp16" and len(names) == 1 and tensors[names[0]].tensor_type.name == "F16"
            and not (permuted and reordered(names[0])))


@dataclass
class Planned:
    """One form a dense file's load converts: its tensors (stacked), kind and row maps."""

    names: tuple[str, ...]
    kind: str
    rows: tuple[np.ndarray | None, ...]


def dense_forms(header: GGUFHeader) -> list[Planned]:
    """The converted forms of a dense file in load order (every layer's projections, the LM head, an
    untied embedding), mapped F16 ones left out; empty where the file is not loaded from its blocks as
    a dense model (experts, a float32 matrix, a type with no C form, no architecture or layer count)."""
    tensors = {t.name: t for t in header.tensors}
    arch, layers = _field(header, "general.architecture"), _field(header, None, "block_count")
    if not isinstance(arch, str) or not isinstance(layers, int) or "token_embd.weight" not in tensors:
        return []
    if any("_exps." in name for name in tensors) or any(
            len(t.shape) == 2 and t.tensor_type.name == "F32" and not ROUTER.search(t.name) for t in tensors.values()):
        return []
    n_head = _field(header, None, "attention.head_count")
    n_kv = _field(header, None, "attention.head_count_kv") or n_head
    permuted = arch == "llama"
    out = []
    try:
        groups = [(names, None) for i in range(layers) for names in projections(tensors, f"blk.{i}.").values()]
        head = "token_embd.weight" if "output.weight" not in tensors else "output.weight"
        groups.append(([head], head_kind(tensors[head])))
        if head != "token_embd.weight":
            groups.append((["token_embd.weight"], None))
        for names, kind in groups:
            kind = kind or widest({natural(tensors[n]) for n in names})
            if is_mapped_f16(tensors, names, kind, permuted):
                continue
            rows = tuple(row_map(n, shape(tensors[n])[0], n_head, n_kv) if permuted else None for n in names)
            out.append(Planned(tuple(names), kind, rows))
    except (KeyError, ValueError, TypeError, ZeroDivisionError):  # a tensor missing, a type with no form
        return []
    return out


def _field(header: GGUFHeader, key: str | None, suffix: str = ""):
    """Metadata ``key``, or ``{architecture}.{suffix}``; None where absent."""
    if key is None:
        arch = _field(header, "general.architecture")
        key = f"{arch}.{suffix}"
    field = header.get_field(key)
    return None if field is None else field.contents()
