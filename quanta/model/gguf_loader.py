"""GGUF checkpoints: metadata into a :class:`ModelConfig`, tensors dequantized into HF naming.

The header is parsed by :mod:`quanta.model.gguf_header`; tensors are dequantized
with the ``gguf`` library and renamed from llama.cpp's
names (``blk.{i}.attn_q.weight``) to the schema of
:mod:`quanta.model.checkpoint_schema`; for the ``llama`` architecture
llama.cpp's q/k row permutation is undone. ``phi3`` files hold fused tensors, split here by rows:
``attn_qkv`` (q, k, v rows stacked) and ``ffn_up`` (gate rows, then up rows: llama.cpp's swiglu
takes the silu of the first half).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from quanta.model import gemma, moe_checkpoint
from quanta.model.checkpoint_schema import StateDict
from quanta.model.config import ModelConfig
from quanta.model.gguf_header import GGUFHeader, read_header
from quanta.model.rope import yarn_attention_factor

#: GGUF ``general.architecture`` -> :attr:`ModelConfig.architecture`.
#: Mistral GGUFs are written with the ``llama`` architecture.
_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                       gemma.GEMMA3: gemma.GEMMA3, **moe_checkpoint.GGUF_MOE_ARCHITECTURES}

#: Whole-model GGUF tensors -> HF names.
_GGUF_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

#: Per-block GGUF tensor stems (``blk.{i}.<stem>.weight``) -> HF module paths.
_GGUF_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **moe_checkpoint.GGUF_MOE_TENSORS,
    **gemma.GGUF_TENSORS,
}

#: GGUF tensors that are not weights: read into the config (``rope_freqs``: per-frequency RoPE divisors)
_NOT_WEIGHTS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def read_config(path: Path) -> ModelConfig:
    """The :class:`ModelConfig` of GGUF file ``path`` from its metadata, without dequantizing.

    Raises:
        ValueError: unsupported architecture, a required key missing, or an
            unsupported RoPE variant.
    """
    reader = read_header(path)
    return _gguf_config(reader, _architecture(reader, path), {t.name: t for t in reader.tensors}, path)


def read_checkpoint(path: Path) -> tuple[ModelConfig, StateDict]:
    """Read metadata and dequantize every tensor of GGUF file ``path``.

    Returns:
        ``(config, state_dict)``: float32 CPU tensors in HF naming, matrices
        ``[out, in]``; MoE tensors still per GGUF stem (not yet canonical).

    Raises:
        ValueError: unsupported architecture, tensor or quantization type.
    """
    reader = read_header(path)
    gguf_arch = _architecture(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    config = _gguf_config(reader, gguf_arch, tensors, path)
    if gguf_arch == "llama" and config.num_experts and "blk.0.ffn_gate_exps.weight" not in tensors:
        raise ValueError(f"{path}: per-expert GGUF tensors (old Mixtral conversions) are not supported; reconvert it")
    state = {}
    # a progress bar on a terminal only (tqdm's disable=None), for multi-GB checkpoints
    for gguf_name, tensor in tqdm(tensors.items(), desc=f"loading {path.name}", unit="tensor", disable=None, leave=False):
        if gguf_name in _NOT_WEIGHTS:
            continue
        weights = _dequantize(tensor)
        if gguf_arch == "llama" and re.search(r"\.attn_[qk]\.", gguf_name):
            n_head = config.num_attention_heads if ".attn_q." in gguf_name else config.num_key_value_heads
            weights = _unpermute_rope_rows(weights, n_head)
        for name, part in _split_fused(gguf_name, weights, config, tensors):
            state[_hf_name_from_gguf(name, path)] = torch.from_numpy(np.ascontiguousarray(part))
    return config, state


def _split_fused(name: str, weights: np.ndarray, config: ModelConfig, tensors: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """``(GGUF name, rows)`` of the separate tensors a fused one holds: ``attn_qkv`` -> ``attn_q``, ``attn_k``,
    ``attn_v``; an ``ffn_up`` without an ``ffn_gate`` beside it (``phi3``) -> ``ffn_gate`` (first half), ``ffn_up``.
    Any other tensor: itself."""
    if ".attn_qkv." in name:
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        parts = np.split(weights, [q, q + kv])
        return [(name.replace(".attn_qkv.", f".attn_{p}."), w) for p, w in zip("qkv", parts, strict=True)]
    if ".ffn_up." in name and name.replace(".ffn_up.", ".ffn_gate.") not in tensors:
        gate, up = np.split(weights, 2)
        return [(name.replace(".ffn_up.", ".ffn_gate."), gate), (name, up)]
    return [(name, weights)]


def gguf_tensor_types(path: str | Path) -> dict[str, str]:
    """GGUF tensor name -> its stored type name (``Q4_1``, ``Q8_0``, ``F32``, ...); parses the
    header and metadata (:class:`GGUFHeader`: 0.04 s for SmolLM2), reads no tensor data."""
    return {t.name: t.tensor_type.name for t in read_header(path).tensors}


def _architecture(reader: GGUFHeader, path: Path) -> str:
    """``general.architecture`` of the file.

    Raises:
        ValueError: an architecture quanta does not implement.
    """
    gguf_arch = _gguf_field(reader, "general.architecture")
    if gguf_arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {gguf_arch!r}; "
            f"supported: {', '.join(_GGUF_ARCHITECTURES)}"
        )
    return gguf_arch


def _gguf_field(reader: GGUFHeader, key: str, default: Any = None) -> Any:
    """Decoded value of metadata ``key`` (str, int, float, bool or list), or ``default``."""
    field = reader.get_field(key)
    if field is None:
        return default
    value = field.contents()
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        # Shortest decimal that is the same float32: 1e-05, not 9.9999997e-06.
        value = float(str(np.float32(value)))
    return value


def _gguf_config(
    reader: GGUFHeader, gguf_arch: str, tensors: dict[str, Any], path: Path
) -> ModelConfig:
    """Translate ``{arch}.*`` / ``tokenizer.ggml.*`` metadata into a ModelConfig.

    Raises:
        ValueError: a required key is missing, the RoPE scaling is not
            supported, or RoPE does not span the whole head.
    """

    def required(key: str) -> Any:
        value = _gguf_field(reader, f"{gguf_arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {gguf_arch}.{key}")
        return value

    hidden, heads = required("embedding_length"), required("attention.head_count")
    head_dim = _gguf_field(reader, f"{gguf_arch}.attention.key_length", hidden // heads)
    rope_dim = _gguf_field(reader, f"{gguf_arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos = [_gguf_field(reader, f"tokenizer.ggml.{k}") for k in eos_keys]
    arch = _GGUF_ARCHITECTURES[gguf_arch]
    moe: dict[str, Any] = {}
    if _gguf_field(reader, f"{gguf_arch}.expert_count"):
        arch = "mixtral" if arch == "llama" else arch
        moe = moe_checkpoint.gguf_moe_fields(lambda key: _gguf_field(reader, f"{gguf_arch}.{key}"), arch)
    return ModelConfig(
        architecture=arch,
        # ggml shapes are innermost-first: token_embd is [hidden, vocab].
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=(_gguf_field(reader, f"{gguf_arch}.feed_forward_length") or moe.get("moe_intermediate_size")
                           or required("feed_forward_length")),
        num_hidden_layers=required("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=_gguf_field(reader, f"{gguf_arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=required("attention.layer_norm_rms_epsilon"),
        rope_theta=_gguf_field(reader, f"{gguf_arch}.rope.freq_base", 10000.0),
        rope_scaling=_gguf_rope_scaling(reader, gguf_arch, tensors, head_dim, path),
        # the context the model runs at (YaRN files: the scaled one, not rope.scaling.original_context_length)
        max_position_embeddings=required("context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors and arch != "olmoe",
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(i for i in eos if i is not None)),
        name=_gguf_field(reader, "general.name", path.stem),
        **moe,
        **(gemma.gguf_fields(lambda key: _gguf_field(reader, f"{gguf_arch}.{key}"), required("block_count"), hidden, heads)
           if arch == gemma.GEMMA3 else {}),
    )


#: ``{arch}.rope.scaling.type`` values quanta computes
_GGUF_ROPE_SCALING_TYPES = ("none", "linear", "yarn")


def _gguf_rope_scaling(
    reader: GGUFHeader, gguf_arch: str, tensors: dict[str, Any], head_dim: int, path: Path
) -> dict | None:
    """``rope_scaling`` (see :mod:`quanta.model.rope`) from ``{arch}.rope.scaling.*`` and the
    ``rope_freqs.weight`` tensor, as llama.cpp reads them; None for plain RoPE.

    - ``rope.scaling.type``: missing means ``linear``, as in llama.cpp; a missing or zero
      ``rope.scaling.factor`` (old files: ``rope.scale_linear``) means 1, no scaling.
    - ``yarn``: ``factor``, ``rope.scaling.original_context_length`` (default: ``context_length``,
      which in YaRN files is already the scaled context and stays the model's context cap),
      ``rope.scaling.yarn_beta_fast`` / ``yarn_beta_slow`` (32 / 1), and the attention factor
      ``0.1 ln(factor) + 1``; with ``rope.scaling.yarn_log_multiplier`` ``m`` (Mistral's
      ``mscale_all_dim``, read as llama.cpp reads it for ``mistral3``) that divided by
      ``0.1 m ln(factor) + 1``. ``yarn_ext_factor`` / ``yarn_attn_factor`` are not read
      (llama.cpp does not for these architectures).
    - ``rope.scaling.attn_factor`` multiplies cos and sin under every type.
    - ``rope_freqs.weight`` (Llama 3.x): ``head_dim / 2`` per-frequency divisors, ``freq_factors``.
    - ``rope_factors_long.weight`` / ``rope_factors_short.weight`` (Phi-3.5's LongRoPE): type
      ``longrope`` with both lists and ``rope.scaling.original_context_length``; which list divides
      the frequencies depends on the served context (:mod:`quanta.model.rope`), as in llama.cpp.

    Raises:
        ValueError: a scaling type other than none / linear / yarn, ``rope_freqs.weight`` or
            LongRoPE factors of the wrong length, LongRoPE factors beside another scaling.
    """

    def key(name: str, default: Any = None) -> Any:
        return _gguf_field(reader, f"{gguf_arch}.rope.scaling.{name}", default)

    kind = key("type", "linear")
    if kind not in _GGUF_ROPE_SCALING_TYPES:
        raise ValueError(f"{path}: unsupported GGUF RoPE scaling type {kind!r} (supported: {', '.join(_GGUF_ROPE_SCALING_TYPES)})")
    factor = float(key("factor") or _gguf_field(reader, f"{gguf_arch}.rope.scale_linear") or 1.0)
    scaling: dict[str, Any] = {}
    if kind == "yarn":
        log_mul = key("yarn_log_multiplier", 0.0)
        scaling = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": key("original_context_length") or _gguf_field(reader, f"{gguf_arch}.context_length"),
            "beta_fast": float(key("yarn_beta_fast", 32.0)),
            "beta_slow": float(key("yarn_beta_slow", 1.0)),
            "attention_factor": yarn_attention_factor(factor, 1.0, log_mul),
        }
    elif kind == "linear" and factor != 1.0:
        scaling = {"rope_type": "linear", "factor": factor}
    if "rope_freqs.weight" in tensors:
        scaling = {"rope_type": "freq_factors", **scaling,
                   "freq_factors": _rope_factors(tensors, "rope_freqs.weight", head_dim, path)}
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        if scaling:
            raise ValueError(f"{path}: LongRoPE factors beside {scaling['rope_type']} RoPE scaling are not supported")
        original = key("original_context_length") or _gguf_field(reader, f"{gguf_arch}.context_length")
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": original,
                   **{f"{kind}_factor": _rope_factors(tensors, f"rope_factors_{kind}.weight", head_dim, path)
                      for kind in ("long", "short")}}
    attn = key("attn_factor", 1.0)
    if attn != 1.0:
        scaling = {"rope_type": "default", **scaling}
        scaling["attention_factor"] = scaling.get("attention_factor", 1.0) * attn
    return scaling or None


def _rope_factors(tensors: dict[str, Any], name: str, head_dim: int, path: Path) -> list[float] | None:
    """The ``head_dim / 2`` values of RoPE factor tensor ``name``, or None where the file lacks it.

    Raises:
        ValueError: the tensor has another length.
    """
    if name not in tensors:
        return None
    factors = _dequantize(tensors[name]).reshape(-1)
    if factors.size != head_dim // 2:
        raise ValueError(f"{path}: {name} has {factors.size} values; head_dim {head_dim} needs {head_dim // 2}")
    return factors.tolist()


def _hf_name_from_gguf(gguf_name: str, path: Path) -> str:
    """HF name of GGUF tensor ``gguf_name`` (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``).

    Raises:
        ValueError: a tensor the dense Llama-family model has no place for.
    """
    if gguf_name in _GGUF_GLOBAL_TENSORS:
        return _GGUF_GLOBAL_TENSORS[gguf_name]
    match = _GGUF_BLOCK_RE.fullmatch(gguf_name)
    if match is None or match[2] not in _GGUF_BLOCK_TENSORS:
        if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", gguf_name):
            raise ValueError(f"{path}: per-expert GGUF tensor {gguf_name!r} (old Mixtral conversion) is not supported; reconvert it")
        raise ValueError(f"{path}: unsupported GGUF tensor {gguf_name!r}")
    layer, stem, kind = match.groups()
    return f"model.layers.{layer}.{_GGUF_BLOCK_TENSORS[stem]}.{kind}"


def _dequantize(tensor: Any) -> np.ndarray:
    """Float32 array of a GGUF tensor in HF layout (``[out, in]`` for matrices).

    ggml lists dimensions innermost first, so the HF shape is the reverse.
    The result is always a fresh, writable array (F32 tensors are otherwise
    views of the read-only file mapping).

    Raises:
        ValueError: a quantization type the ``gguf`` library cannot dequantize.
    """
    try:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"tensor {tensor.name}: {e}") from e
    if not weights.flags.writeable:
        weights = weights.copy()
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return weights.astype(np.float32, copy=False).reshape(shape)


def _unpermute_rope_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for the ``llama`` architecture.

    llama.cpp's converter reorders each head's rows from HF's half-split RoPE
    layout (first half, second half) to interleaved pairs:
    ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)``. This is the inverse.

    Args:
        weights: ``[n_head * head_dim, in]`` weight or ``[n_head * head_dim]`` bias.
        n_head: query heads for ``attn_q``, key/value heads for ``attn_k``.
    """
    half = weights.shape[0] // n_head // 2
    per_head = weights.reshape(n_head, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(weights.shape)
