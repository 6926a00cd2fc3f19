"""Validated configuration of the scheduler and the engine.

Defaults follow ds4-server's batched mode (the server the seed study measured):
8 resident sequences, prefill quantum 2048 tokens with or without a decode in
flight, prefill cap (graph boundary) 4096 positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from quanta.engine.block_pool import blocks_for
from quanta.engine.policies import POLICIES
from quanta.engine.policies.knobs import PREFILL_CAP, Knob
from quanta.engine.scheduler import Scheduler

DEFAULT_POLICY = "batched"
DEFAULT_MAX_NUM_SEQS = 8


@dataclass(slots=True)
class SchedulerConfig:
    """The policy name, ``max_num_seqs`` and the knobs that policy takes.

    Args:
        name: a key of :data:`quanta.engine.policies.POLICIES`.
        max_num_seqs: resident sequences (KV slots), >= 1.
        knobs: knob name -> value; missing knobs of the policy take their
            declared default (:class:`~quanta.engine.policies.knobs.Knob`).
            After construction it holds every knob of the policy, in the
            policy's order.

    Raises:
        ValueError: unknown policy, a knob the policy does not take, a size
            that is not a positive integer, a quantum or chunk larger than the
            cap, ``admit_k`` above ``max_num_seqs``, or ``max_num_batched_tokens``
            below ``max_num_seqs``.
    """

    name: str = DEFAULT_POLICY
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    knobs: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown scheduler {self.name!r}; choose one of: {', '.join(POLICIES)}")
        self.knobs = _checked_knobs(POLICIES[self.name].knobs, self.name, self.max_num_seqs, self.knobs)

    def with_knob(self, knob: str, value: int) -> SchedulerConfig:
        """A validated copy with ``knob`` set to ``value`` (e.g. a resolved ``auto`` quantum).

        Raises:
            ValueError: as the constructor.
        """
        return replace(self, knobs={**self.knobs, knob: value})

    def build(self) -> Scheduler:
        """A fresh scheduler instance of this configuration."""
        return POLICIES[self.name](self.max_num_seqs, **self.knobs)

    def describe(self) -> str:
        """``scheduler=batched max_num_seqs=8 prefill_quantum=2048 ...`` (the startup line)."""
        parts = [f"scheduler={self.name}", f"max_num_seqs={self.max_num_seqs}"]
        parts += [f"{k}={v}" for k, v in self.knobs.items()]
        return " ".join(parts)


def _checked_knobs(declared: tuple[Knob, ...], policy: str, max_num_seqs: int, given: dict[str, int]) -> dict[str, int]:
    """Every knob of the policy (``given`` values, else defaults), checked against the declarations.

    Raises:
        ValueError: as :class:`SchedulerConfig`, naming the flags.
    """
    foreign = sorted(set(given) - {k.name for k in declared})
    if foreign:
        flags, takes = ", ".join("--" + k.replace("_", "-") for k in foreign), ", ".join(k.flag for k in declared)
        raise ValueError(f"{flags} does not apply to --scheduler {policy} (it takes: {takes or 'no knobs'})")
    for k, v in [("max_num_seqs", max_num_seqs), *given.items()]:  # the user's values first
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be a positive integer, got {v!r}")
    cap = given.get(PREFILL_CAP.name, PREFILL_CAP.default)
    knobs = {k.name: given.get(k.name, min(k.default, cap) if k.within_cap else k.default) for k in declared}
    for k in declared:
        if k.within_cap and PREFILL_CAP.name in knobs and knobs[k.name] > cap:
            raise ValueError(f"{k.flag} ({knobs[k.name]}) is larger than {PREFILL_CAP.flag} ({cap})")
    for k in declared:
        value = knobs[k.name]
        if k.seqs_bound == "at_most" and value > max_num_seqs:
            raise ValueError(f"{k.flag} ({value}) is larger than --max-num-seqs ({max_num_seqs}); {k.seqs_reason}")
        if k.seqs_bound == "at_least" and value < max_num_seqs:
            raise ValueError(f"{k.flag} ({value}) is smaller than --max-num-seqs ({max_num_seqs}); {k.seqs_reason}")
    return knobs


#: values of ``--quantization`` (see :func:`quanta.launch.resolve_quantization`;
#: the forms are :data:`quanta.model.quant.FORMS`)
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4", "fp16", "q4_1", "q8_0")

#: values of ``--prompt-weights``: what prompt rows multiply by (:mod:`quanta.model.linear`)
PROMPT_WEIGHTS = ("auto", "blocks", "reference", "form")


#: ``--kv-cache-dtype`` values (:func:`quanta.launch.resolve_kv_dtype`)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "q8_0")

#: KV positions per block (``--block-size``): a multiple of 8 (the C attention's
#: vector width). 32 rather than vLLM's 16: a 180k-token context's block table
#: is 5,625 entries (the executor sends every table each step), and a prefix
#: shared by blocks loses at most 31 of its tokens, nothing beside the
#: thousands of a shared agent prompt.
DEFAULT_BLOCK_SIZE = 32


@dataclass(slots=True)
class EngineConfig:
    """What to load and how much room to give it.

    Args:
        model: GGUF file or Hugging Face directory; None for the embedded SmolLM2.
        dtype: ``bfloat16`` or ``float32``; None picks bf16 where the CPU has
            native bf16 (avx512_bf16 / AMX), else fp32.
        max_model_len: tokens per sequence (prompt + output); None means the
            model's trained context length.
        max_queue: waiting requests before HTTP 429; None is unbounded.
        served_model_name: the model id clients send; None uses the file's name.
        prefix_cache: share the KV blocks of identical prompt prefixes across
            sequences and keep them after they end (``--no-prefix-cache`` turns it off).
        quantization: weight forms for decode- and chunk-sized matmuls: ``auto``
            (a GGUF's own 4-/8-bit types, plus fp16 copies on CPUs without
            native bf16), ``none``, ``int8``, ``int4``, ``fp16``, ``q4_1`` or
            ``q8_0``; see :func:`quanta.launch.resolve_quantization`.
        native_decode: run all-decode steps with the C glue between matmuls
            (:mod:`quanta.model.native_decode`) where the model and machine allow.
        block_size: KV positions per block of the paged cache, a positive
            multiple of 8.
        kv_cache_memory / kv_cache_tokens: the KV pool's budget in bytes or in
            tokens (at most one; neither: :mod:`quanta.engine.kv_budget`'s default).
        prompt_weights: ``blocks`` (a GGUF's weights converted tensor by tensor from the file's
            own blocks into C forms that compute every row, :mod:`quanta.model.gguf_blocks`),
            ``reference`` (the dequantized weights, oneDNN-packed, for prompt rows, beside the
            decode forms), ``form`` (the dequantized path keeping only the projections' q4_1 / q8_0
            forms, each rebuilt per prompt call), or ``auto``: ``blocks`` where the file allows
            (a dense GGUF, ``--quantization auto``, the C kernels built), else ``reference``.
        kv_cache_dtype: the KV cache's elements: ``auto``, ``float32``,
            ``bfloat16``, ``float16`` or ``q8_0`` (:func:`quanta.launch.resolve_kv_dtype`).
    """

    model: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    max_queue: int | None = None
    served_model_name: str | None = None
    prefix_cache: bool = True
    quantization: str = "auto"
    native_decode: bool = True
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | None = None
    kv_cache_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    prompt_weights: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in (None, "bfloat16", "float32"):
            raise ValueError(f"--dtype must be bf16 or fp32, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be auto, fp32, bf16, fp16 or q8_0, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {self.quantization!r}")
        if self.prompt_weights not in PROMPT_WEIGHTS:
            raise ValueError(f"--prompt-weights must be one of {', '.join(PROMPT_WEIGHTS)}, got {self.prompt_weights!r}")
        if self.prompt_weights == "blocks" and self.quantization != "auto":
            raise ValueError(f"--prompt-weights blocks takes the file's own forms: it needs --quantization auto, "
                             f"got {self.quantization}")
        if self.prompt_weights == "form" and self.quantization not in ("auto", "q4_1", "q8_0"):
            raise ValueError(f"--prompt-weights form needs --quantization auto, q4_1 or q8_0 (the forms it keeps), "
                             f"got {self.quantization}")
        if self.kv_cache_memory is not None and self.kv_cache_tokens is not None:
            raise ValueError("give --kv-cache-memory or --kv-cache-tokens, not both")
        for name in ("max_model_len", "max_queue", "kv_cache_memory", "kv_cache_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
        if self.block_size < 8 or self.block_size % 8:
            raise ValueError(f"--block-size must be a positive multiple of 8, got {self.block_size}")
        tokens, length = self.kv_cache_tokens, self.max_model_len
        if tokens and length and blocks_for(tokens, self.block_size) < blocks_for(length, self.block_size):
            raise ValueError(f"--kv-cache-tokens {tokens} holds less than one sequence of --max-model-len {length}")
