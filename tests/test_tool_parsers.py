"""Native tool-call formats parsed from fixed model outputs, their grammars, and template rendering."""

from __future__ import annotations

import json

import pytest

from quanta.server.tool_formats.base import HermesParser, Llama3JsonParser, MistralParser
from quanta.server.tool_formats.registry import choose_parser
from quanta.server.tool_formats.templates import render_for_template, template_reads_tools

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_hermes_calls_and_surrounding_text():
    text = 'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n' \
           '<tool_call>{"name": "read_file", "arguments": {"path": "b.py"}}</tool_call>'
    parsed = HermesParser().parse(text)
    assert calls(parsed) == [("read_file", {"path": "a.py"}), ("read_file", {"path": "b.py"})]
    assert parsed.content == "Let me look."


def test_hermes_unclosed_last_call_and_string_arguments():
    parsed = HermesParser().parse('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}')
    assert calls(parsed) == [("f", {"x": 1})]
    assert parsed.content is None


def test_hermes_invalid_json_stays_text():
    text = "<tool_call>{not json}</tool_call>"
    parsed = HermesParser().parse(text)
    assert parsed.calls == [] and parsed.content == text


def test_llama3_json_single_and_multiple():
    p = Llama3JsonParser()
    assert calls(p.parse('{"name": "read_file", "parameters": {"path": "x"}}')) == [("read_file", {"path": "x"})]
    assert calls(p.parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 2}}')) == \
        [("a", {}), ("b", {"k": 2})]
    plain = "The answer is {probably} 4."
    assert p.parse(plain).calls == [] and p.parse(plain).content == plain


def test_mistral_array_v11_and_dropped_marker():
    p = MistralParser()
    assert calls(p.parse('[TOOL_CALLS][{"name": "read_file", "arguments": {"path": "x"}}]')) == [("read_file", {"path": "x"})]
    assert calls(p.parse('[TOOL_CALLS]read_file[ARGS]{"path": "y"}')) == [("read_file", {"path": "y"})]
    # [TOOL_CALLS] is a special token: decoding without specials leaves the bare array
    parsed = p.parse('[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]')
    assert calls(parsed) == [("f", {"a": 1}), ("g", {})]
    assert p.parse("[1, 2] is a list").calls == []


@pytest.mark.parametrize("template,name", [
    ("{% for m in messages %}<tool_call>{% endfor %}{{ tools }}", "hermes"),
    ("{{ '[TOOL_CALLS]' }}{{ tools }}", "mistral"),
    ("<|python_tag|>{{ tools }}", "llama3_json"),
    ("{{ messages }}", "hermes"),
    (None, "hermes"),
])
def test_parser_chosen_from_template(template, name):
    assert choose_parser(template).name == name


def test_parser_override_and_unknown():
    assert choose_parser("<tool_call>", "mistral").name == "mistral"
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        choose_parser(None, "nope")


def test_template_reads_tools():
    assert template_reads_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_reads_tools("{% for message in messages %}{{ message['content'] }}{% endfor %}")


def test_fallback_rendering_puts_tools_calls_and_results_in_text():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "read a"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "AAA"},
        {"role": "tool", "tool_call_id": "c2", "content": "BBB"},
    ]
    out, tools = render_for_template(msgs, TOOLS, native=False)
    assert tools is None
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.") and '"read_file"' in out[0]["content"]
    assert HermesParser().parse(out[2]["content"]).calls[0].arguments == '{"path": "a"}'
    assert out[3] == {"role": "user", "content": "<tool_response>\nAAA\n</tool_response>\n<tool_response>\nBBB\n</tool_response>"}
    assert len(out) == 4


def test_native_rendering_gives_argument_objects():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a"}'}}]}]
    out, tools = render_for_template(msgs, TOOLS, native=True)
    assert tools == TOOLS and out[0]["tool_calls"][0]["function"]["arguments"] == {"path": "a"}


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser(), MistralParser()])
def test_grammars_compile_for_each_format(parser):
    llguidance = pytest.importorskip("llguidance")
    for parallel in (False, True):
        grammar = parser.grammar(TOOLS, parallel)
        assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar.lark)) == ""
