"""Grammars no finite text matches: refused when compiled (a 400 upstream), and
a matcher that errs mid-generation fails its request alone instead of leaving
the row unmasked. Real llguidance matchers on the embedded SmolLM2's tokenizer;
the engine test runs the real engine loop in-process (no server)."""

from __future__ import annotations

import llguidance
import pytest
import torch

from quanta.config import EngineConfig, SchedulerConfig
from quanta.engine.grammar import (
    Grammar,
    GrammarCompiler,
    GrammarConstraint,
    GrammarError,
    MatcherError,
    json_rule,
    never_terminates,
)
from quanta.engine.sampling import SamplingParams
from quanta.launch import build_engine, load_model

RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, torch.float32)


@pytest.fixture(scope="module")
def compiler(loaded):
    return GrammarCompiler(loaded.tokenizer.hf, loaded.tokenizer.eos_token_ids)


@pytest.mark.parametrize("schema,endless", [
    (RECURSIVE, True),
    ({"$ref": "#"}, True),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
      "$ref": "#/$defs/n"}, True),
    ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, True),
    ({"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]}, True),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, False),  # {} ends it
    ({"anyOf": [{"type": "string"}, RECURSIVE]}, False),
    ({"type": "array", "items": {"$ref": "#"}}, False),  # [] ends it
    ({"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                      "required": ["kids"]}}, "$ref": "#/$defs/n"}, False),  # a tree: {"kids": []}
    ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, False),  # untyped: a string satisfies it
    ({"$ref": "https://example.com/s.json"}, False),  # not local: llguidance's to judge
])
def test_never_terminates(schema, endless):
    assert never_terminates(schema) is endless


def test_compiler_refuses_recursive_schemas_and_compiles_the_rest(compiler):
    for schema in (RECURSIVE, {"$ref": "#"}):
        with pytest.raises(GrammarError, match=r"\$ref"):
            compiler.constraint(Grammar.json_schema(schema))
    tool = f'start: "<call>" {json_rule({"type": "object", "properties": {"x": RECURSIVE}, "required": ["x"]})} "</call>"'
    with pytest.raises(GrammarError, match=r"\$ref"):  # a schema embedded in a larger (tool-call) grammar
        compiler.constraint(Grammar(tool))
    compiler.constraint(Grammar.json_schema({"type": "object", "properties": {"a": {"$ref": "#"}}}))


def _unchecked(compiler, schema) -> GrammarConstraint:
    """A constraint built past the compiler's checks (as a grammar that errs only later would be)."""
    tok = compiler._tokenizer()
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(Grammar.json_schema(schema).lark), log_level=0)
    return GrammarConstraint(matcher, tok.vocab_size)


def test_a_matcher_error_raises_instead_of_unmasking(compiler, loaded):
    constraint = _unchecked(compiler, RECURSIVE)
    row = torch.zeros(compiler._tokenizer().vocab_size)
    constraint.mask(row)
    allowed = torch.isfinite(row).nonzero().flatten().tolist()
    assert len(allowed) == 1  # '{"': llguidance errs only on the next mask
    constraint.accept(allowed[0])
    with pytest.raises(MatcherError, match="constrained decoding failed"):
        constraint.mask(torch.zeros_like(row))


def test_a_matcher_that_errs_mid_run_fails_its_request_alone(compiler, loaded):
    """Before the fix the erring row was left unmasked and generated free text to max_tokens."""
    engine = build_engine(loaded, EngineConfig(max_model_len=256), SchedulerConfig("batched", 4, {}))
    healthy = engine.add_request(loaded.tokenizer.encode("The capital of France is"),
                                 SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    bad = engine.add_request(loaded.tokenizer.encode("Write JSON:"),
                             SamplingParams(max_tokens=6, temperature=0, constraint=_unchecked(compiler, RECURSIVE)))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    last_bad = [o for o in outputs if o.seq_id == bad.seq_id][-1]
    assert last_bad.finished and last_bad.finish_reason == "error" and "error id" in last_bad.error
    assert loaded.tokenizer.hf.decode(bad.output_token_ids) == '{"'
    assert [o for o in outputs if o.seq_id == healthy.seq_id][-1].finish_reason == "length"
    assert len(healthy.output_token_ids) == 6 and not engine.sequences


@pytest.mark.parametrize(("schema", "says"), [
    ({"type": "object", "properties": {"a": {"$ref": "#/defs/nope"}}}, "Pointer '/defs/nope' does not exist"),
    ({"type": "strin"}, "Invalid type: strin"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"type": "string", "format": "ipv9"}, "Unknown format: ipv9"),
])
def test_an_unsupported_schema_is_refused_in_one_sentence(compiler, schema, says):
    with pytest.raises(GrammarError) as caught:
        compiler.constraint(Grammar.json_schema(schema))
    message = str(caught.value)
    assert message.startswith("the JSON schema is not supported: ") and says in message
    assert "\n" not in message and "%json" not in message and "x-guidance" not in message  # no grammar internals
