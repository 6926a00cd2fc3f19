"""Constrained decoding with llguidance: grammars that mask each step's logits.

Why llguidance (1.9.1) and not xgrammar: both are maintained engines that vLLM
and SGLang use, but xgrammar's Linux wheel pulls in triton (a GPU compiler,
hundreds of MB) and ``apache-tvm-ffi``, while llguidance is one Rust wheel with
no dependencies, computes masks on the CPU lazily (no vocabulary-wide
precompilation per grammar: a matcher is built in ~1 ms), and takes JSON
schemas, regexes and Lark grammars (with JSON schemas embedded by ``%json``),
which is exactly what tool calls in a model's native format need.

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
