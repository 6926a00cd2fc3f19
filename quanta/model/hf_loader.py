"""Hugging Face model directories: ``config.json`` into a :class:`ModelConfig`, safetensors into a state dict.

Tensors keep their HF names (MoE ones are made canonical by the caller with
:func:`quanta.model.moe_checkpoint.canonicalize`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from quanta.model import moe_checkpoint
from quanta.model.checkpoint_schema import StateDict
from quanta.model.config import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig

#: Buffers some HF checkpoints carry that are recomputed, not loaded.
_IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)

#: RoPE scaling types the model implements (besides none).
_ROPE_SCALING_TYPES = ("linear", "llama3")


def read_config(path: Path) -> ModelConfig:
    """The :class:`ModelConfig` of HF directory ``path`` from ``config.json`` (+ ``generation_config.json``).

    Raises:
        ValueError: no ``config.json``, an unsupported ``model_type`` or RoPE scaling.
    """
    config_file, gen_file = path / "config.json", path / "generation_config.json"
    if not config_file.is_file():
        raise ValueError(f"{path}: no config.json; not a Hugging Face model directory")
    generation = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    return hf_config(json.loads(config_file.read_text()), generation, path)


def read_checkpoint(path: Path) -> tuple[ModelConfig, StateDict]:
    """The config and the safetensors of HF directory ``path``.

    Returns:
        ``(config, state_dict)``: float32 CPU tensors under their HF names;
        ``lm_head.weight`` dropped when the embeddings are tied.

    Raises:
        ValueError: as :func:`read_config`, or no ``*.safetensors``.
    """
    config = read_config(path)
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


def hf_config(hf: dict, generation: dict, path: Path) -> ModelConfig:
    """Translate an HF ``config.json`` dict into a ModelConfig.

    A sliding attention window (Mistral v0.1, Qwen2 ``use_sliding_window``)
    caps ``max_position_embeddings`` at the window, within which sliding and
    full attention are identical.

    Raises:
        ValueError: unsupported ``model_type`` or RoPE scaling.
    """
    arch = hf.get("model_type")
    if arch in ("gemma3", "gemma3_text"):  # Gemma's HF norms are 1 + w, its names its own: not mapped here
        raise ValueError(f"{path}: Gemma 3 is read from GGUF files only (llama.cpp's convert_hf_to_gguf.py writes one)")
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
