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
with ``finish_reason: stop``. A grammar no finite text matches (a
``$ref`` cycle with no way out, or a matcher already in an error state
before its first token) is a :class:`GrammarError` when it is compiled; a
matcher that errs later raises from :meth:`GrammarConstraint.mask`, so its
request alone fails (``finish_reason: error``) rather than running
unconstrained. Unconstrained requests never touch this module.

Before anything recursive or costly runs on a grammar (parsing a schema's
text, the termination check, llguidance's compiler), its size is checked
against the bounds of :mod:`quanta.engine.grammar_bounds`, by walks that
never recurse; a grammar over one is a :class:`GrammarError` naming it.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from quanta.engine.grammar_bounds import MAX_GRAMMAR_CHARS, GrammarTooLarge, check_choices, check_grammar, load_schema

#: JSON generated under a grammar has no free whitespace: a small model would
#: otherwise fill max_tokens with newlines (llguidance's option, see its docs/json_schema.md).
#: ``oneOf`` is enforced as ``anyOf`` (llguidance cannot check that exactly one branch
#: matches): agents' tool schemas use it (Qwen Code's first tool), and refusing the
#: schema would refuse the agent; an answer matches at least one branch.
_JSON_OPTIONS = {"whitespace_flexible": False, "coerce_one_of": True}


@dataclass(frozen=True, slots=True)
class Grammar:
    """A grammar in llguidance's Lark dialect (``start`` rule first)."""

    lark: str
    #: options of a choice grammar (:meth:`choice`), bounded when it is compiled
    options: int = 0

    @classmethod
    def json_schema(cls, schema: dict | str, field: str = "schema") -> Grammar:
        """Text matching ``schema``: a JSON Schema object, or its JSON text
        (parsed after a non-recursive check of its length and nesting).

        Raises:
            GrammarError: ``schema`` is not a JSON object (or its text), or its
                text is over a bound; the message starts with ``field``.
        """
        if isinstance(schema, str):
            try:
                schema = load_schema(schema)
            except ValueError as exc:  # GrammarTooLarge, or not JSON
                raise GrammarError(f"{field}: not a usable JSON schema: {exc}") from exc
        if not isinstance(schema, dict):
            raise GrammarError(f"{field}: a JSON schema is a JSON object, not {type(schema).__name__}")
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
        return cls("start: " + " | ".join(json.dumps(o) for o in options), len(options))


def json_rule(schema: dict) -> str:
    """A Lark expression matching JSON that validates against ``schema``."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


def _embedded_schemas(lark: str):
    """The JSON schemas that :func:`json_rule` put in ``lark`` (after each ``%json``)."""
    decoder = json.JSONDecoder()
    at = lark.find("%json ")
    while at >= 0:
        try:
            schema, _ = decoder.raw_decode(lark, at + len("%json "))
        except RecursionError as exc:
            raise GrammarTooLarge("the schema is nested too deeply") from exc
        except ValueError:
            schema = None
        if isinstance(schema, dict):
            yield schema
        at = lark.find("%json ", at + 1)


def never_terminates(schema: dict) -> bool:
    """Whether no finite JSON value can satisfy ``schema`` through its local
    ``$ref`` cycles (``{"$ref": "#"}``, or an object that requires a property
    whose schema is the object again).

    Conservative: True only when proven, from ``$ref``, ``allOf``, ``anyOf``,
    ``oneOf``, required properties of an ``object`` and ``minItems`` of an
    ``array``; other unsatisfiable schemas are llguidance's to refuse. Cost:
    a few passes over the schema, one per ``$ref`` at most. The walks
    recurse as deep as the schema nests: callers check
    :data:`quanta.engine.grammar_bounds.MAX_SCHEMA_DEPTH` first
    (:func:`quanta.engine.grammar_bounds.check_grammar`).
    """
    targets = {}
    for ref in _local_refs(schema):
        target = _resolve(schema, ref)
        if target is not None:
            targets[ref] = target
    done: set[str] = set()
    changed = True
    while changed:  # least fixpoint: a ref terminates once one of its branches does
        changed = False
        for ref, target in targets.items():
            if ref not in done and _terminates(target, done):
                done.add(ref)
                changed = True
    return not _terminates(schema, done)


def _local_refs(node) -> set[str]:
    refs, stack = set(), [node]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                refs.add(ref)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return refs


def _resolve(root: dict, ref: str):
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _terminates(s, done: set[str]) -> bool:
    """False only if ``s`` provably needs a ``$ref`` not in ``done`` (not known to terminate)."""
    if s is False:
        return False
    if not isinstance(s, dict):
        return True
    ref = s.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in done:
        return False
    if any(not _terminates(x, done) for x in _list(s.get("allOf"))):
        return False
    for key in ("anyOf", "oneOf"):
        branches = _list(s.get(key))
        if branches and not any(_terminates(x, done) for x in branches):
            return False
    if s.get("type") in ("object", ["object"]):
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        if any(p in props and not _terminates(props[p], done) for p in _list(s.get("required"))):
            return False
    if s.get("type") in ("array", ["array"]) and isinstance(s.get("minItems"), int):
        prefix = _list(s.get("prefixItems"))
        needed = prefix[: s["minItems"]] + ([s.get("items", True)] if s["minItems"] > len(prefix) else [])
        if any(not _terminates(x, done) for x in needed):
            return False
    return True


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _lark_regex(pattern: str) -> str:
    return pattern.replace("/", "\\/")


def one_sentence(message: str) -> str:
    """llguidance's compile error as one line: no position prefix, no echo of the grammar's source
    or caret lines, the parts joined (``failed to compile JSON schema: X`` reads ``the JSON schema
    is not supported: X``)."""
    message = re.sub(r"^at \d+\(\d+\): ", "", message.strip())
    parts = [line.strip() for line in message.splitlines()]
    parts = [re.sub(r"^error: ", "", p) for p in parts if p and not re.match(r"^(\d+ \||\^+$)", p)]
    text = re.sub(r":$", "", ": ".join(re.sub(r":$", "", p) for p in parts))
    return text.replace("failed to compile JSON schema: ", "the JSON schema is not supported: ")


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
        import llguidance.hf  # imports transformers (~1.5 s): left to the first grammar

        with self._lock:
            if self._ll is None:
                self._ll = llguidance.hf.from_tokenizer(self._hf, eos_token=self._eos or None)
            return self._ll

    def constraint(self, grammar: Grammar) -> GrammarConstraint:
        """A fresh matcher for one request.

        Raises:
            GrammarError: the grammar is over a bound of
                :mod:`quanta.engine.grammar_bounds` (checked first), does not
                compile, an embedded JSON schema never terminates
                (:func:`never_terminates`), or the matcher fails computing its
                first mask.
        """
        try:
            check_choices(grammar.options)
            schemas = list(_embedded_schemas(grammar.lark)) if len(grammar.lark) <= MAX_GRAMMAR_CHARS else []
            check_grammar(grammar.lark, schemas)
        except GrammarTooLarge as exc:
            raise GrammarError(str(exc)) from exc
        for schema in schemas:
            if never_terminates(schema):
                raise GrammarError("Unsatisfiable schema: a $ref cycle has no finite value (every branch recurses)")
        tok = self._tokenizer()
        try:
            compiled = llguidance.LLMatcher.grammar_from_lark(grammar.lark)
        except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError/RuntimeError
            raise GrammarError(one_sentence(str(exc))) from exc
        problem = llguidance.LLMatcher.validate_grammar(compiled, tok)
        if problem and not problem.startswith("WARNING"):
            raise GrammarError(one_sentence(problem))
        matcher = llguidance.LLMatcher(tok, compiled, log_level=0)
        if matcher.is_error():
            raise GrammarError(one_sentence(matcher.get_error()))
        constraint = GrammarConstraint(matcher, tok.vocab_size)
        try:
            constraint.first_mask()
        except MatcherError as exc:
            raise GrammarError(f"the grammar allows no first token: {exc}") from exc
        return constraint


class MatcherError(RuntimeError):
    """A request's matcher erred or allows no token; its request fails alone."""


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

    def _compute(self) -> torch.Tensor | str:
        """The allowed-token mask, or the matcher's error message."""
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if self._matcher.is_error():
            return self._matcher.get_error()
        allowed = torch.from_numpy(bits[: self._vocab].astype(bool))
        return allowed if allowed.any() else "the grammar allows no next token"

    def first_mask(self) -> None:
        """Wait for the first mask (~1 ms for common grammars).

        Raises:
            MatcherError: the matcher erred or allows no token.
        """
        self._allowed()

    def _allowed(self) -> torch.Tensor:
        allowed = self._next.result()
        if isinstance(allowed, str):
            raise MatcherError(f"constrained decoding failed: {allowed.splitlines()[0] if allowed else 'matcher error'}")
        return allowed

    def mask(self, row: torch.Tensor) -> None:
        """Disallowed tokens (and padded rows past the tokenizer's vocabulary) to ``-inf``.

        Raises:
            MatcherError: the matcher erred (llguidance's limits, a grammar
                with no finite text) or allows no token; the sampler fails
                this request alone instead of sampling it unconstrained.
        """
        allowed = self._allowed()[: row.shape[0]]
        row[: allowed.shape[0]].masked_fill_(~allowed, float("-inf"))
        row[allowed.shape[0]:] = float("-inf")

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)
        self._next = _MASK_POOL.submit(self._compute)
