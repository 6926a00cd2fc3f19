"""Validated configuration of the scheduler and the engine.

Defaults follow ds4-server's batched mode (the server the seed study measured):
8 resident sequences, prefill quantum 2048 tokens with or without a decode in
flight, prefill cap (graph boundary) 4096 positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from quanta.engine.policies import POLICIES
from quanta.engine.scheduler import Scheduler

#: Default value of every scheduler knob (tokens, or sequences for max_num_seqs).
KNOB_DEFAULTS: dict[str, int] = {
    "prefill_quantum": 2048,
    "mixed_prefill_quantum": 2048,
    "prefill_cap": 4096,
    "admit_k": 1,
    "chunk": 512,
    "max_num_batched_tokens": 512,
}


@dataclass(slots=True)
class SchedulerConfig:
    """The policy name, ``max_num_seqs`` and the knobs that policy takes.

    Args:
        name: a key of :data:`quanta.engine.policies.POLICIES`.
        max_num_seqs: resident sequences (KV slots), >= 1.
        knobs: knob name -> value; missing knobs of the policy take
            :data:`KNOB_DEFAULTS`.

    Raises:
        ValueError: unknown policy, a knob the policy does not take, a size
            that is not a positive integer, a quantum or chunk larger than the
            cap, ``admit_k`` above ``max_num_seqs``, or ``max_num_batched_tokens``
            below ``max_num_seqs``.
    """

    name: str = "batched"
    max_num_seqs: int = 8
    knobs: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown scheduler {self.name!r}; choose one of: {', '.join(POLICIES)}")
        allowed = POLICIES[self.name][1]
        foreign = sorted(set(self.knobs) - set(allowed))
        if foreign:
            flags = ", ".join("--" + k.replace("_", "-") for k in foreign)
            raise ValueError(f"{flags} does not apply to --scheduler {self.name} (it takes: {_flags(allowed) or 'no knobs'})")
        for k, v in [("max_num_seqs", self.max_num_seqs), *self.knobs.items()]:  # the user's values first
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be a positive integer, got {v!r}")
        given, cap = self.knobs, self.knobs.get("prefill_cap", KNOB_DEFAULTS["prefill_cap"])
        self.knobs = {k: given.get(k, _default(k, cap)) for k in allowed}
        cap = self.knobs.get("prefill_cap")
        for k in ("prefill_quantum", "mixed_prefill_quantum", "chunk"):
            if cap is not None and self.knobs.get(k, 0) > cap:
                raise ValueError(f"--{k.replace('_', '-')} ({self.knobs[k]}) is larger than --prefill-cap ({cap})")
        if self.knobs.get("admit_k", 0) > self.max_num_seqs:
            raise ValueError(f"--admit-k ({self.knobs['admit_k']}) is larger than --max-num-seqs ({self.max_num_seqs}); nothing would ever be admitted")
        if self.knobs.get("max_num_batched_tokens", self.max_num_seqs) < self.max_num_seqs:
            raise ValueError(
                f"--max-num-batched-tokens ({self.knobs['max_num_batched_tokens']}) is smaller than --max-num-seqs "
                f"({self.max_num_seqs}); a step must fit one decode token per resident sequence"
            )

    def with_knob(self, knob: str, value: int) -> "SchedulerConfig":
        """A validated copy with ``knob`` set to ``value`` (e.g. a resolved ``auto`` quantum).

        Raises:
            ValueError: as the constructor.
        """
        return replace(self, knobs={**self.knobs, knob: value})

    def build(self) -> Scheduler:
        """A fresh scheduler instance of this configuration."""
        cls = POLICIES[self.name][0]
        return cls(self.max_num_seqs, **self.knobs)

    def describe(self) -> str:
        """``scheduler=batched max_num_seqs=8 prefill_quantum=2048 ...`` (the startup line)."""
        parts = [f"scheduler={self.name}", f"max_num_seqs={self.max_num_seqs}"]
        parts += [f"{k}={v}" for k, v in self.knobs.items()]
        return " ".join(parts)


def _default(knob: str, cap: int) -> int:
    """A knob's default, with chunk sizes lowered to a smaller prefill cap the user chose."""
    if knob in ("prefill_quantum", "mixed_prefill_quantum", "chunk"):
        return min(KNOB_DEFAULTS[knob], cap)
    return KNOB_DEFAULTS[knob]


def _flags(names) -> str:
    return ", ".join("--" + n.replace("_", "-") for n in names)


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
        prefix_cache: reuse the K/V a free slot still holds for the longest
            common prefix of a new prompt (``--no-prefix-cache`` turns it off).
        quantization: weight forms for decode- and chunk-sized matmuls: ``auto``
            (a GGUF's own 4-/8-bit types, plus fp16 copies on CPUs without
            native bf16), ``none``, ``int8``, ``int4`` or ``fp16``; see
            :func:`quanta.launch.resolve_quantization`.
    """

    model: str | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    max_queue: int | None = None
    served_model_name: str | None = None
    prefix_cache: bool = True
    quantization: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in (None, "bfloat16", "float32"):
            raise ValueError(f"--dtype must be bf16 or fp32, got {self.dtype!r}")
        if self.quantization not in ("auto", "none", "int8", "int4", "fp16"):
            raise ValueError(f"--quantization must be auto, none, int8, int4 or fp16, got {self.quantization!r}")
        for name in ("max_model_len", "max_queue"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
