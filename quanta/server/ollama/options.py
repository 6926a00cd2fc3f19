"""Ollama's ``options`` object: what each option does here.

Mapped onto quanta's sampling: ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``stop``,
``num_predict`` (the output cap; -1 (Ollama's "no limit"), -2 ("fill the
context") and 0 mean the room the prompt leaves in the context; left out:
``--max-tokens-default``) and ``num_ctx`` (the request's context: above the
server's ``max_model_len`` it is clamped to it, as Ollama clamps it to the
model's trained context; below, the prompt and output must fit in it, and a
prompt that does not is a 400 naming ``options.num_ctx``, where Ollama would
drop the prompt's start).

Sampling values a request leaves out come from the server's defaults
(``--temperature`` / ``--top-p`` / ``--top-k``, the checkpoint's
``generation_config.json``), else from Ollama's own defaults
(:data:`OLLAMA_DEFAULTS`: temperature 0.8, top_k 40, top_p 0.9).

The other options Ollama documents (load-time ones such as ``num_gpu`` and
``num_thread``, and ``repeat_penalty``, ``repeat_last_n``, ``mirostat``,
``tfs_z``, ``typical_p``, ``num_keep``, ``penalize_newline``) are accepted
with no effect and named in the server log, as Ollama ignores options a
model does not use. An undocumented option one edit away from a known one
(``temprature``) is a 400 naming it (:mod:`quanta.server.field_rule`).

quanta's extension: ``tool_choice`` (``auto``, ``none``, ``required`` or a
tool's name), which Ollama's API lacks: ``required`` or a name forces one
call by the grammar of the model's tool-call format.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from quanta.engine.sampling import SEED_RANGE, SamplingParams
from quanta.server.field_rule import FieldRule
from quanta.server.protocol import NullMeansDefault, StopList, check_stop_strings, integer, number

#: options Ollama documents (``Options`` of its API and of the official clients)
OLLAMA_OPTIONS = frozenset({
    "numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap",
    "use_mlock", "embedding_only", "num_thread", "num_keep", "seed", "num_predict", "top_k", "top_p", "min_p", "tfs_z",
    "typical_p", "repeat_last_n", "temperature", "repeat_penalty", "presence_penalty", "frequency_penalty", "mirostat",
    "mirostat_tau", "mirostat_eta", "penalize_newline", "stop",
})

#: Ollama's defaults of the sampling options (used where neither the request nor the server sets one)
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}

#: the options that become :class:`SamplingParams` fields of the same name
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty")


class Options(FieldRule, NullMeansDefault):
    """``options`` (see the module docstring)."""

    DOCUMENTED = OLLAMA_OPTIONS

    temperature: number(ge=0.0, le=2.0) | None = None
    top_p: number(gt=0.0, le=1.0) | None = None
    top_k: integer(ge=-1) | None = None
    min_p: number(ge=0.0, le=1.0) | None = None
    seed: integer(ge=SEED_RANGE[0], le=SEED_RANGE[1]) | None = None
    presence_penalty: number(ge=-2.0, le=2.0) | None = None
    frequency_penalty: number(ge=-2.0, le=2.0) | None = None
    stop: Annotated[StopList, AfterValidator(lambda stop: check_stop_strings(stop, "stop"))] | None = None
    num_predict: integer(ge=-2) | None = None
    num_ctx: integer(ge=1) | None = None
    tool_choice: str | None = Field(None, description="quanta's extension: auto, none, required or a tool's name")

    def output_cap(self) -> int | None:
        """``num_predict`` as an output cap; None: the server's default (left out) or the room left (``<= 0``)."""
        return self.num_predict if self.num_predict and self.num_predict > 0 else None

    @property
    def fills_context(self) -> bool:
        """``num_predict`` -1, -2 or 0: generate until the context is full (or the model stops)."""
        return self.num_predict is not None and self.num_predict <= 0

    def context(self, max_model_len: int) -> int:
        """The request's context: ``num_ctx`` clamped to ``max_model_len`` (all of it when left out)."""
        return min(self.num_ctx or max_model_len, max_model_len)

    def sampling_params(self, max_tokens: int, server_defaults: dict) -> SamplingParams:
        """The request's :class:`SamplingParams`: its options over the server's defaults over Ollama's."""
        given = {k: getattr(self, k) for k in SAMPLING if getattr(self, k) is not None}
        server = {k: v for k, v in server_defaults.items() if k in SAMPLING}
        values = {**OLLAMA_DEFAULTS, **server, **given}
        return SamplingParams(max_tokens=max_tokens, stop=list(self.stop or []), **values)

    def ignored_names(self) -> list[str]:
        """The options sent that change nothing here, as ``options.<name>`` (documented and unknown ones)."""
        return [f"options.{name}" for name in self.ignored_fields() + self.unknown_fields()]
