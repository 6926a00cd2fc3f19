"""Constrained decoding with llguidance: grammars that mask each step's logits.

Why llguidance (1.9.1) and not xgrammar (0.2.8), measured on CPU with
``benchmarks/grammar_engines.py --repeats 9`` (scratch venv, see its
docstring; SmolLM2's 49k vocabulary, 2-core AMD EPYC, two runs, results in
``benchmarks/results/grammar_engines.md``). Both are maintained engines that
vLLM and SGLang use. xgrammar computes masks faster: median per token
(full-vocabulary bitmask) 0.003-0.004 ms vs llguidance's 0.013-0.025 ms on a
tool-call schema, 0.03-0.04 vs 0.31-0.35 ms on a regex with ``[a-z ]{1,60}``, 0.002
vs 0.02 ms on a timestamp regex (llguidance is faster only on free-form
``json_object``: 0.004-0.005 vs 0.011-0.013 ms); p99 at most 0.11 ms vs 0.55 ms.
llguidance compiles faster, and compiling is on each request's path before
its first token: grammar to first mask in 1-2 ms for all four grammars, vs
xgrammar's 8-9 ms for either JSON grammar and 0.46-0.57 s for the
``{1,60}`` regex (only on the timestamp regex is xgrammar faster: 0.2 ms).
Vocabulary setup, once per process: ~0.5 s (38 MB) vs ~0.2 s (6 MB). Installed: llguidance is one 8 MB
Rust wheel with no dependencies; xgrammar needs triton (997 MB, a GPU
compiler a CPU engine never runs), ``apache-tvm-ffi`` and pydantic. We keep
llguidance: its per-token cost is well under a millisecond (quanta's unpacking
to a bool tensor included: 0.03-0.04 ms median on the tool call, 0.37-0.52 ms
on the ``{1,60}`` regex) and is computed on a worker thread during a forward
pass of ~120 ms (``benchmarks/grammar_overhead.py``), so xgrammar's faster
masks would not shorten a step here, while its compile times and gigabyte of
dependencies would be paid. The trade-off flips where the forward pass is
short and many rows are constrained (a GPU, large batches) and schemas repeat
(xgrammar caches compiled grammars). llguidance also takes Lark grammars with
JSON schemas embedded by ``%json``, which is what tool calls in a model's
native format need.

A :class:`Grammar` is compiled once per request; :meth:`GrammarCompiler.constraint`
makes the :class:`GrammarConstraint` the sampler consults
(:class:`quanta.engine.sampling.TokenConstraint`). Once the grammar is
complete only the end-of-sequence tokens stay allowed, so the request ends
with ``finish_reason: stop``. Unconstrained requests never touch this module.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.hf
import numpy as np
import torch

#: JSON generated under a grammar has no free whitespace: a small model would
#: otherwise fill max_tokens with newlines (llguidance's option, see its docs/json_schema.md).
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True, slots=True)
class Grammar:
    """A grammar in llguidance's Lark dialect (``start`` rule first)."""

    lark: str

    @classmethod
    def json_schema(cls, schema: dict) -> Grammar:
        """Text matching ``schema`` (a JSON Schema object)."""
        return cls(f"start: {json_rule(schema)}")

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: json_object``)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls(f"start: /{_lark_regex(pattern)}/")

    @classmethod
    def choice(cls, options: list[str]) -> Grammar:
        """Exactly one of ``options``."""
        return cls("start: " + " | ".join(json.dumps(o) for o in options))


def json_rule(schema: dict) -> str:
    """A Lark expression matching JSON that validates against ``schema``."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


def _lark_regex(pattern: str) -> str:
    return pattern.replace("/", "\\/")


class GrammarError(ValueError):
    """The grammar (schema, regex) is invalid or unsupported; the message says why."""


class GrammarCompiler:
    """Compiles grammars against one tokenizer (the llguidance vocabulary is
    built once, ~0.3 s for a 49k vocabulary, on first use).

    Args:
        hf_tokenizer: a fast Hugging Face tokenizer.
        eos_token_ids: tokens allowed once the grammar is complete.
    """

    def __init__(self, hf_tokenizer, eos_token_ids: set[int]) -> None:
        self._hf = hf_tokenizer
        self._eos = sorted(eos_token_ids)
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.hf.from_tokenizer(self._hf, eos_token=self._eos or None)
            return self._ll

    def constraint(self, grammar: Grammar) -> GrammarConstraint:
        """A fresh matcher for one request.

        Raises:
            GrammarError: the grammar does not compile.
        """
        tok = self._tokenizer()
        try:
            compiled = llguidance.LLMatcher.grammar_from_lark(grammar.lark)
        except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError/RuntimeError
            raise GrammarError(str(exc)) from exc
        problem = llguidance.LLMatcher.validate_grammar(compiled, tok)
        if problem and not problem.startswith("WARNING"):
            raise GrammarError(problem)
        matcher = llguidance.LLMatcher(tok, compiled, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarConstraint(matcher, tok.vocab_size)


#: Threads computing next-token masks while the model runs its forward pass
#: (llguidance releases the GIL while it computes).
_MASK_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="quanta-grammar")


class GrammarConstraint:
    """One request's matcher; implements :class:`quanta.engine.sampling.TokenConstraint`.

    The mask for the next token is computed on a worker thread as soon as
    the previous token is accepted, so it overlaps the next forward pass
    instead of lengthening the step for every sequence in the batch.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._next: Future = _MASK_POOL.submit(self._compute)

    def _compute(self) -> torch.Tensor | None:
        if self._matcher.is_error():
            return None
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: self._vocab].astype(bool))
        return allowed if allowed.any() else None

    def mask(self, row: torch.Tensor) -> None:
        """Disallowed tokens (and padded rows past the tokenizer's vocabulary) to ``-inf``.

        A matcher in an error state (it never should be: only allowed tokens
        are sampled) leaves the row unmasked rather than allowing nothing.
        """
        allowed = self._next.result()
        if allowed is None:
            return
        allowed = allowed[: row.shape[0]]
        row[: allowed.shape[0]].masked_fill_(~allowed, float("-inf"))
        row[allowed.shape[0]:] = float("-inf")

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)
        self._next = _MASK_POOL.submit(self._compute)
