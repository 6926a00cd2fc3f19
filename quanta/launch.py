"""Assemble a ready engine from configuration: load, pick dtype, size the KV cache.

Used by ``quanta serve``, ``quanta generate``, the tests and the benchmarks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.engine import Engine
from quanta.engine.executor import ModelExecutor
from quanta.model.config import ModelConfig
from quanta.model.llama import LlamaModel
from quanta.model.loader import embedded_model_path, load_checkpoint
from quanta.model.tokenizer import Tokenizer

log = logging.getLogger("quanta")

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists avx512_bf16 or amx_bf16 (bf16 matmuls ~2x fp32 there)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str | None) -> torch.dtype:
    """``bfloat16``/``float32``; None picks bf16 on CPUs with native bf16, else fp32."""
    if name is None:
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return _DTYPES[name]


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    name: str


def load_model(path: str | None, dtype: torch.dtype) -> LoadedModel:
    """Load weights and tokenizer from a GGUF file or HF directory (None: embedded SmolLM2).

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: an unsupported architecture or checkpoint layout.
    """
    model_path = Path(path) if path else embedded_model_path()
    if not model_path.exists():
        raise FileNotFoundError(f"model path {model_path} does not exist")
    t0 = time.monotonic()
    cfg, state = load_checkpoint(model_path)
    model = LlamaModel(cfg)
    model.load_hf_state_dict(state)
    model.to(dtype).eval()
    model.pack_weights()
    tokenizer = Tokenizer.from_path(model_path)
    log.info("loaded %s (%s, %d layers) in %.1f s as %s", model_path.name, cfg.architecture, cfg.num_hidden_layers, time.monotonic() - t0, dtype)
    name = model_path.stem if model_path.is_file() else model_path.name
    return LoadedModel(model, tokenizer, cfg, model_path, name)


def build_engine(loaded: LoadedModel, engine_cfg: EngineConfig, sched_cfg: SchedulerConfig) -> Engine:
    """:func:`_build_engine`, with the MoE executor's per-step expert statistics recorded in the trace."""
    engine = _build_engine(loaded, engine_cfg, sched_cfg)
    if loaded.config.is_moe and isinstance(engine.executor, ModelExecutor):
        engine.trace.annotate = engine.executor.take_expert_stats
    return engine


def _build_engine(loaded: LoadedModel, engine_cfg: EngineConfig, sched_cfg: SchedulerConfig) -> Engine:
    """An engine over ``loaded`` with a fresh scheduler and KV cache.

    ``max_model_len`` defaults to the model's trained context length; prefix
    reuse across slots is on unless ``engine_cfg.prefix_cache`` is False.
    """
    max_len = engine_cfg.max_model_len or loaded.config.max_position_embeddings
    executor = ModelExecutor(loaded.model, sched_cfg.max_num_seqs, max_len)
    eos = set(loaded.config.eos_token_ids) | loaded.tokenizer.eos_token_ids
    scheduler = sched_cfg.build()
    if engine_cfg.prefix_cache:
        scheduler.enable_prefix_cache()
    return Engine(scheduler, executor, max_len, loaded.tokenizer, eos)
