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
from quanta.engine.model_executor import ModelExecutor
from quanta.engine.stop_strings import TextState
from quanta.model.config import ModelConfig
from quanta.model.llama import LlamaModel
from quanta.model.loader import embedded_model_path, gguf_tensor_types, load_checkpoint
from quanta.model.quant import max_quantized_rows
from quanta.model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("quanta")

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def cpu_flags() -> set[str]:
    """The first CPU's feature flags from /proc/cpuinfo (empty where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists avx512_bf16 or amx_bf16 (bf16 matmuls ~2x fp32 there)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_summary() -> str:
    """The vector features that choose kernels, e.g. ``avx2 fma avx512f avx512_bf16``."""
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
    flags = cpu_flags()
    return " ".join(f for f in wanted if f in flags) or "no avx2"


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
    #: the matmul kernels chosen at load, e.g. ``projections=int4(rows<=32) lm_head=reference reference=float32-F.linear``
    kernels: str = ""


#: GGUF tensor types and the quantized form that holds them (``auto``): 4-bit
#: blocks are int4 groups of 32 exactly (see :mod:`quanta.model.quant`); 5- to
#: 8-bit blocks are requantized to int8 per channel; float tensors stay as they are.
_GGUF_FORMS = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q5_0": "int8", "Q5_1": "int8", "Q5_K": "int8",
               "Q6_K": "int8", "Q8_0": "int8", "Q8_K": "int8"}


def resolve_quantization(name: str, path: Path) -> tuple[str, str]:
    """``(projections, lm_head)`` quantized forms for ``--quantization name``.

    ``none``: the dequantized reference weights only. ``int8`` / ``int4``: the
    projections in that form. ``auto``: a GGUF's own type (its first layer's
    ``attn_q``) mapped by ``_GGUF_FORMS``; ``none`` for other checkpoints. The
    LM head always keeps the reference weights: an int8 head (per channel, from
    the embedded model's Q8_0 embeddings) turned the README's greedy answer
    "The capital of France is Paris." into "L'Étoile, la Marseillaise, ..."
    (kept as ``tests/test_quant.py::test_default_quantization_answers_like_the_reference``).

    Raises:
        ValueError: an unknown name.
    """
    if name in ("none", "int8", "int4"):
        return name, "none"
    if name != "auto":
        raise ValueError(f"--quantization must be auto, none, int8 or int4, got {name!r}")
    types = gguf_tensor_types(path) if path.is_file() else {}
    return _GGUF_FORMS.get(types.get("blk.0.attn_q.weight", ""), "none"), "none"


def load_model(path: str | None, dtype: torch.dtype, quantization: str = "none") -> LoadedModel:
    """Load weights and tokenizer from a GGUF file or HF directory (None: embedded SmolLM2).

    ``quantization`` (see :func:`resolve_quantization`) adds int8/int4 forms of
    the projections and LM head for decode-sized calls; the reference weights
    in ``dtype`` stay for larger calls.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: an unsupported architecture or checkpoint layout, or an unknown quantization.
    """
    model_path = Path(path) if path else embedded_model_path()
    if not model_path.exists():
        raise FileNotFoundError(f"model path {model_path} does not exist")
    forms = resolve_quantization(quantization, model_path)
    t0 = time.monotonic()
    cfg, state = load_checkpoint(model_path)
    model = LlamaModel(cfg)
    model.load_hf_state_dict(state)
    model.to(dtype).eval()
    model.pack_weights()
    bf16 = dtype == torch.bfloat16
    model.quantize_weights(*forms, {k: max_quantized_rows(k, bf16) for k in ("int8", "int4")})
    tokenizer = Tokenizer.from_path(model_path)
    kernels = model.describe_kernels()
    log.info("loaded %s (%s, %d layers) in %.1f s as %s; cpu: %s; kernels: %s", model_path.name, cfg.architecture,
             cfg.num_hidden_layers, time.monotonic() - t0, dtype, cpu_summary(), kernels)
    name = model_path.stem if model_path.is_file() else model_path.name
    return LoadedModel(model, tokenizer, cfg, model_path, name, kernels)


def build_engine(loaded: LoadedModel, engine_cfg: EngineConfig, sched_cfg: SchedulerConfig) -> Engine:
    """An engine over ``loaded`` with a fresh scheduler and KV cache.

    ``max_model_len`` defaults to the model's trained context length; prefix
    reuse across slots is on unless ``engine_cfg.prefix_cache`` is False; each
    request gets a :class:`TextState` over the model's tokenizer.
    """
    max_len = engine_cfg.max_model_len or loaded.config.max_position_embeddings
    executor = ModelExecutor(loaded.model, sched_cfg.max_num_seqs, max_len)
    eos = set(loaded.config.eos_token_ids) | loaded.tokenizer.eos_token_ids
    scheduler = sched_cfg.build()
    if engine_cfg.prefix_cache:
        scheduler.enable_prefix_cache()
    return Engine(scheduler, executor, max_len, lambda p: TextState.create(IncrementalDetokenizer(loaded.tokenizer), p.stop), eos)
