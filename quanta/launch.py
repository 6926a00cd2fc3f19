"""Assemble a ready engine from configuration: load, pick dtype, size the KV cache.

Used by ``quanta serve``, ``quanta generate``, the tests and the benchmarks.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from quanta.config import QUANTIZATION_CHOICES, EngineConfig, SchedulerConfig
from quanta.engine.block_pool import BlockPool
from quanta.engine.engine import Engine
from quanta.engine.kv_budget import format_bytes, num_blocks, physical_memory
from quanta.engine.model_executor import ModelExecutor
from quanta.engine.sampling import SamplingParams
from quanta.engine.stop_strings import TextState
from quanta.model.attention import KVFormat, bytes_per_block, kv_format
from quanta.model.config import ModelConfig
from quanta.model.cpu import ISA_FLAGS, cpu_flags, cpu_has_native_bf16, cpu_summary, isa_flags  # noqa: F401 (read here by machine.py, server/run.py)
from quanta.model.gguf_blocks import load_block_model
from quanta.model.gguf_blocks import unsupported_reason as blocks_unsupported
from quanta.model.gguf_plan import asks_for_blocks
from quanta.model.llama import LlamaModel
from quanta.model.loader import embedded_model_path, gguf_tensor_types, load_checkpoint, load_config
from quanta.model.native.forms import available as native_forms_available
from quanta.model.quant import NATIVE_FORMS, fp16_kernel_available
from quanta.model.rope import RotaryEmbedding, rope_type
from quanta.model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("quanta")

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


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
    #: the matmul kernels chosen at load, e.g.
    #: ``projections=q4_1 lm_head=q8_0 reference=float32-onednn-packed``
    kernels: str = ""


#: GGUF tensor types and the forms that hold them (``auto``): 4-bit blocks
#: are Q4_1 blocks (quanta's C kernel) or int4 groups of 32 (PyTorch's), the
#: same values (see :mod:`quanta.model.quant`); 5- to 8-bit blocks are
#: requantized to Q8_0 blocks or int8 per channel; float tensors stay as they are.
_GGUF_FORMS = {"Q4_0": ("q4_1", "int4"), "Q4_1": ("q4_1", "int4"), "Q4_K": ("q4_1", "int4"),
               **{t: ("q8_0", "int8") for t in ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_K")}}


def resolve_quantization(name: str, path: Path, bf16_reference: bool) -> tuple[str | None, str | None]:
    """``(projection form, lm_head form)`` for ``--quantization name`` (None: the reference).

    Forms are used by decode rows at every batch size; prompt rows always take
    the reference (:mod:`quanta.model.linear`). ``none``: the dequantized
    reference weights only. ``fp16`` / ``int8`` / ``int4`` / ``q4_1`` /
    ``q8_0``: that form of the projections. ``auto``: for a GGUF whose first
    layer's ``attn_q`` has a type in ``_GGUF_FORMS``, its 4- or 8-bit form —
    ``q4_1`` / ``q8_0`` (quanta's C kernels, integer dot products) where they
    build, else ``int4`` / ``int8`` — else ``fp16``. fp16 is dropped beside a
    bf16 reference (it reads as many bytes and is slower).

    The LM head takes ``q8_0`` blocks where the C kernels build and the
    projections take a C form (llama.cpp's choice for a Q8_0 ``token_embd``),
    else an fp16 copy beside an fp32 reference, else the reference: an int8
    head per channel, from the embedded model's Q8_0 embeddings, turned the
    README's greedy answer "The capital of France is Paris." into
    "L'Étoile, la Marseillaise, ..." on an avx512_bf16 machine (the prompt
    is a near-tie at its first token; so did Q8_0 blocks with 8-bit
    activations beside an fp32 reference), while Q8_0 blocks with the
    kernels' 15-bit activations keep it in both dtypes
    (``tests/test_quant.py::test_default_quantization_answers_like_the_reference``).

    Raises:
        ValueError: an unknown name.
    """
    if name not in QUANTIZATION_CHOICES:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {name!r}")
    if name == "none":
        return None, None
    native = native_forms_available()
    if name == "auto":
        types = gguf_tensor_types(path) if path.is_file() else {}
        kinds = _GGUF_FORMS.get(types.get("blk.0.attn_q.weight", ""), ("fp16", "fp16"))
        name = kinds[0] if native else kinds[1]
    fp16 = "fp16" if not bf16_reference and fp16_kernel_available() else None
    head = "q8_0" if native and name in NATIVE_FORMS else fp16
    return (fp16 if name == "fp16" else name), head


class PromptWeightsError(ValueError):
    """``--prompt-weights form`` where the loaded model has no q4_1 / q8_0 form to keep."""


class ModelLoadError(ValueError):
    """The model's file or directory cannot be read into a model (its message names the path and why)."""


def load_model(path: str | None, dtype: torch.dtype, quantization: str = "none", native_decode: bool = True,
               prompt_weights: str = "reference") -> LoadedModel:
    """Load weights and tokenizer from a GGUF file or HF directory (None: embedded SmolLM2).

    ``prompt_weights`` (see :class:`quanta.config.EngineConfig`): ``blocks`` builds the model from
    the GGUF's own blocks (:mod:`quanta.model.gguf_blocks`; ``auto`` picks it where the file and
    machine allow); otherwise the checkpoint is dequantized, ``quantization`` (see
    :func:`resolve_quantization`) adds a decode form of the projections and LM head, and the
    reference weights in ``dtype`` compute prompt rows (``form``: the reference of every projection
    with a q4_1 / q8_0 form is freed, :meth:`~quanta.model.llama.LlamaModel.drop_reference_weights`).
    ``native_decode`` runs all-decode steps with the C glue of :mod:`quanta.model.native_decode`
    where the model and machine allow.

    Raises:
        FileNotFoundError: the path does not exist.
        ModelLoadError: the file cannot be read into a model: truncated or malformed, an
            unsupported architecture, checkpoint layout or tensor type, an unknown quantization,
            ``blocks`` where the file cannot be read so (the message names the path).
        PromptWeightsError: ``form`` where no projection has a q4_1 / q8_0 form.
    """
    model_path = Path(path) if path else embedded_model_path()
    if not model_path.exists():
        raise FileNotFoundError(f"model path {model_path} does not exist")
    t0 = time.monotonic()
    try:
        cfg, model, tokenizer = _read_model(model_path, dtype, quantization, prompt_weights)
    except PromptWeightsError:
        raise
    except (ValueError, OSError) as exc:  # the file's own fault (truncated, unsupported): one line
        why = str(exc) if str(exc).startswith(str(model_path)) else f"{model_path}: {exc}"
        raise ModelLoadError(f"--model {why}") from exc
    decode = model.enable_native_decode() if native_decode else "torch (--native-decode off)"
    if model.native is not None:
        decode += f"(threads={model.native.tuner})"
    kernels = f"{model.describe_kernels()} decode={decode}"
    return_freed_heap()
    log.info("loaded %s (%s, %d layers) in %.1f s as %s; weights %s; cpu: %s; kernels: %s", model_path.name,
             cfg.architecture, cfg.num_hidden_layers, time.monotonic() - t0, dtype, format_bytes(model.weight_bytes()),
             cpu_summary(), kernels)
    name = model_path.stem if model_path.is_file() else model_path.name
    return LoadedModel(model, tokenizer, cfg, model_path, name, kernels)


def _read_model(path: Path, dtype: torch.dtype, quantization: str, prompt_weights: str) -> tuple:
    """``(config, model, tokenizer)`` of ``path``; the tokenizer, and the longest text of a token
    that the server's prompt checks take, are built beside the weights (their repacking runs in C
    without the GIL). Meanwhile the GIL changes hands every 0.1 ms, not 5: the weights' thread takes
    it back after each C call (a tensor's few) without waiting out the tokenizer's Python
    (load_model of the 1B Q4_K_M: median 1.66 s instead of 2.12 s, 6 alternating runs, 2 cores)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="quanta-tokenizer") as pool:
            tokenizer_job = pool.submit(_tokenizer, path)
            cfg = _blocks_config(path, quantization, prompt_weights)
            if cfg is not None:
                model = load_block_model(path, cfg, dtype)
            else:
                cfg, model = _load_dequantized(path, dtype, quantization, prompt_weights)
            return cfg, model, tokenizer_job.result()
    finally:
        sys.setswitchinterval(interval)


def _tokenizer(path: Path) -> Tokenizer:
    tokenizer = Tokenizer.from_path(path)
    _ = tokenizer.max_token_chars  # computed once, here
    return tokenizer


def _blocks_config(path: Path, quantization: str, prompt_weights: str) -> ModelConfig | None:
    """The file's config where the model is to be built from the GGUF's own blocks
    (``--prompt-weights blocks``, or ``auto`` where :func:`quanta.model.gguf_blocks.unsupported_reason`
    finds nothing against it), else None.

    Raises:
        ValueError: ``blocks`` asked for a file or machine that cannot take it.
    """
    if prompt_weights not in ("auto", "blocks") or quantization != "auto":
        return None
    is_gguf = asks_for_blocks(path, quantization, prompt_weights)
    cfg = load_config(path) if is_gguf else None
    reason = blocks_unsupported(cfg, path) if is_gguf else "not a GGUF file"
    if reason and prompt_weights == "blocks":
        raise ValueError(f"--prompt-weights blocks cannot read {path.name}: {reason}")
    return None if reason else cfg


def _load_dequantized(path: Path, dtype: torch.dtype, quantization: str, prompt_weights: str) -> tuple:
    """``(config, model)`` from the dequantized checkpoint, with the reference weights in ``dtype``
    and the decode forms of ``quantization``."""
    forms = resolve_quantization(quantization, path, dtype == torch.bfloat16)
    cfg, state = load_checkpoint(path)
    model = LlamaModel(cfg)
    model.load_hf_state_dict(state)
    del state  # the float32 checkpoint: freed before the conversion and packing add their copies
    model.to(dtype).eval()
    model.pack_weights()
    model.quantize_weights(*forms)
    model.drop_plain_weights()
    if prompt_weights == "form" and not model.drop_reference_weights():
        raise PromptWeightsError(f"--prompt-weights form needs q4_1 or q8_0 forms of the projections; --quantization "
                                 f"{quantization} gave {model.describe_kernels()}")
    return cfg, model


def release_load_memory() -> None:
    """What a process that has loaded its model no longer needs: the GGUF readers' memory maps
    (:func:`quanta.model.gguf_header.forget_headers`), then the C heap's free pages."""
    import gc

    from quanta.model.gguf_header import forget_headers

    forget_headers()
    gc.collect()
    return_freed_heap()


def return_freed_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``): a load frees the
    checkpoint's float32 tensors and the plain weights, which glibc would otherwise keep
    resident (~0.2 GB for the embedded model). Nothing where the C library is not glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> KVFormat:
    """The KV cache's element dtype for ``--kv-cache-dtype name``: ``auto`` is bf16 for a bf16
    model and fp16 for an fp32 one (half the memory of fp32; fp16 keeps 3 more mantissa bits than
    bf16 and K/V values are well within its range: the greedy tests against transformers' fp32
    answers pass with it)."""
    if name == "auto":
        return kv_format(torch.bfloat16 if model_dtype == torch.bfloat16 else torch.float16)
    return kv_format(name)


def kv_block_bytes(cfg: ModelConfig, engine_cfg: EngineConfig, model_dtype: torch.dtype) -> int:
    """Bytes of one KV block (all layers' K and V of ``block_size`` tokens) in the cache dtype."""
    dtype = resolve_kv_dtype(engine_cfg.kv_cache_dtype, model_dtype)
    return bytes_per_block(cfg.num_hidden_layers, cfg.num_key_value_heads, engine_cfg.block_size, cfg.head_dim, dtype)


def kv_cache_blocks(loaded: LoadedModel, engine_cfg: EngineConfig, max_len: int, max_num_seqs: int) -> int:
    """Blocks of the KV pool for ``engine_cfg``'s budget (:func:`quanta.engine.kv_budget.num_blocks`)."""
    return _pool_blocks(loaded.config, engine_cfg, loaded.model.dtype, max_len, max_num_seqs)


def _pool_blocks(cfg: ModelConfig, engine_cfg: EngineConfig, model_dtype: torch.dtype, max_len: int,
                 max_num_seqs: int) -> int:
    """:func:`kv_cache_blocks` from a model's config and dtype alone (no weights needed)."""
    return num_blocks(kv_block_bytes(cfg, engine_cfg, model_dtype), engine_cfg.block_size, max_len, max_num_seqs,
                      engine_cfg.kv_cache_memory, engine_cfg.kv_cache_tokens, physical_memory())


def check_kv_budget(engine_cfg: EngineConfig, max_num_seqs: int) -> None:
    """Refuse, before any weight is read, a KV budget that cannot hold one ``--max-model-len``
    sequence or that exceeds the machine's memory (the model's config is read from the file's
    header or ``config.json``).

    Raises:
        quanta.engine.kv_budget.KVBudgetError: the budget is too small or too large.
        FileNotFoundError / ValueError: the model cannot be read (loading would fail the same way).
    """
    if engine_cfg.kv_cache_memory is None and engine_cfg.kv_cache_tokens is None and engine_cfg.max_model_len is None:
        return
    cfg = load_config(Path(engine_cfg.model) if engine_cfg.model else embedded_model_path())
    _pool_blocks(cfg, engine_cfg, resolve_dtype(engine_cfg.dtype), engine_cfg.max_model_len or cfg.max_position_embeddings,
                 max_num_seqs)


def build_engine(loaded: LoadedModel, engine_cfg: EngineConfig, sched_cfg: SchedulerConfig) -> Engine:
    """An engine over ``loaded`` with a fresh scheduler and KV block pool.

    ``max_model_len`` defaults to the model's trained context length; the pool
    holds the budget :func:`kv_cache_blocks` computes; prefix sharing across
    sequences is on unless ``engine_cfg.prefix_cache`` is False; each request gets
    a :class:`TextState` over the model's tokenizer. A LongRoPE model's RoPE takes the
    factors of ``max_model_len`` (long above the original context, as llama.cpp picks by its context).

    Raises:
        quanta.engine.kv_budget.KVBudgetError: the KV budget does not hold one ``max_model_len`` sequence.
    """
    max_len = engine_cfg.max_model_len or loaded.config.max_position_embeddings
    if max_len > loaded.config.max_position_embeddings:  # served as asked (long-context tests), as llama.cpp does
        log.warning("--max-model-len %d is above the model's trained context (%d tokens): positions past it were "
                    "never trained and the output there may degrade", max_len, loaded.config.max_position_embeddings)
    if rope_type(loaded.config) == "longrope" and max_len != loaded.config.max_position_embeddings:
        loaded.model.rope = RotaryEmbedding(loaded.config, max_len)  # LongRoPE's factors follow the served context
    num_blocks = kv_cache_blocks(loaded, engine_cfg, max_len, sched_cfg.max_num_seqs)
    kv_dtype = resolve_kv_dtype(engine_cfg.kv_cache_dtype, loaded.model.dtype)
    executor = ModelExecutor(loaded.model, num_blocks, engine_cfg.block_size, kv_dtype=kv_dtype)
    eos = set(loaded.config.eos_token_ids) | loaded.tokenizer.eos_token_ids
    scheduler = sched_cfg.build()
    scheduler.use_blocks(BlockPool(num_blocks, engine_cfg.block_size), engine_cfg.prefix_cache)
    return Engine(scheduler, executor, max_len, lambda p: text_state(loaded.tokenizer, eos, p), eos)


def text_state(tokenizer: Tokenizer, eos: set[int], params: SamplingParams) -> TextState:
    """A request's :class:`TextState`: special tokens decoded as ``params`` says; when they are
    kept, the end-of-output tokens (``eos``, ``stop_token_ids``) are still left out of the text."""
    keep = not params.skip_special_tokens
    hidden = eos | set(params.stop_token_ids) if keep else ()
    return TextState.create(IncrementalDetokenizer(tokenizer, skip_special_tokens=not keep), params.stop, hidden)
