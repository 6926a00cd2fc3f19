"""XML-like call parameters (Qwen3-Coder, GLM-4.5) typed by the request's tool schemas.

A parameter the schema types ``string`` stays the text the model wrote, even
when that text reads as JSON; ``integer``, ``number``, ``boolean``,
``object`` and ``array`` values are read from the text (which stays a string
when it is not one); an untyped parameter or a tool the request did not send
is JSON when its text reads as JSON. A whole parse and a stream fed one
character at a time give the same arguments.
"""

from __future__ import annotations

import json

import pytest

from quanta.server.tool_formats.params import param_value, schema_types
from quanta.server.tool_formats.reasoning import REASONING
from quanta.server.tool_formats.registry import TOOL_PARSERS, bound_parser, output_parser
from quanta.server.tool_formats.stream import ArgumentsDelta, CallClosed

PROPS = {
    "path": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
    "force": {"type": "boolean"}, "items": {"type": "array"}, "opts": {"type": "object"},
    "maybe": {"type": ["string", "null"]}, "mode": {"enum": ["1", "2"]}, "loose": {},
    "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
}
TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": PROPS}}}]

#: (parameter, text the model wrote, value with the schema, value without it)
VALUES = [
    ("path", "123", "123", 123), ("path", "true", "true", True), ("path", "null", "null", "null"),
    ("path", "[1]", "[1]", [1]), ("path", '{"a": 1}', '{"a": 1}', {"a": 1}), ("path", " 4.5 ", " 4.5 ", 4.5),
    ("path", "a\nb", "a\nb", "a\nb"),
    ("count", "7", 7, 7), ("count", " 7 ", 7, 7), ("count", "7.0", 7, 7.0), ("count", "seven", "seven", "seven"),
    ("count", "7.5", "7.5", 7.5), ("count", "true", "true", True),
    ("ratio", "0.25", 0.25, 0.25), ("ratio", "3", 3, 3), ("ratio", "1e3", 1000.0, 1000.0),
    ("ratio", "NaN", "NaN", "NaN"), ("loose", "Infinity", "Infinity", "Infinity"),
    ("force", "true", True, True), ("force", "False", False, "False"), ("force", "yes", "yes", "yes"),
    ("items", "[1, 2]", [1, 2], [1, 2]), ("items", "['a', None]", ["a", None], "['a', None]"),
    ("items", '{"a": 1}', '{"a": 1}', {"a": 1}),
    ("opts", '{"a": [1]}', {"a": [1]}, {"a": [1]}), ("opts", "{'a': True}", {"a": True}, "{'a': True}"),
    ("opts", "{1, 2}", "{1, 2}", "{1, 2}"),
    ("maybe", "null", None, "null"), ("maybe", "12", "12", 12),
    ("mode", "1", "1", 1), ("loose", "12", 12, 12), ("loose", "x", "x", "x"),
    ("either", "12", 12, 12), ("either", "twelve", "twelve", "twelve"),
]


def _qwen(params: list[tuple[str, str]], name: str = "edit") -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"Sure.\n<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _glm(params: list[tuple[str, str]], name: str = "edit") -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in params)
    return f"Sure.\n<tool_call>{name}\n{body}</tool_call>"


WRITE = {"qwen3_coder": _qwen, "glm45": _glm}


def _streamed(parser, text: str) -> list[tuple[str, str]]:
    """Each call's (name, arguments) from a stream fed ``text`` one character at a time."""
    stream, events = parser.stream(), []
    for ch in text:
        events += stream.feed(ch)
    events += stream.finish()
    calls = [e.call for e in events if isinstance(e, CallClosed)]
    for i, call in enumerate(calls):
        assert "".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == i) == call.arguments
    return [(c.name, c.arguments) for c in calls]


def _args(parser, text: str) -> dict:
    """The one call's arguments of ``text``, checked to be the same whole and streamed."""
    parsed = parser.parse(text)
    assert [c.name for c in parsed.calls] == ["edit"] and (parsed.content or "").strip() == "Sure."
    assert _streamed(parser, text) == [(c.name, c.arguments) for c in parsed.calls]
    return json.loads(parsed.calls[0].arguments)


@pytest.mark.parametrize("fmt", sorted(WRITE))
def test_values_follow_the_schema_whole_and_streamed(fmt):
    parser = TOOL_PARSERS[fmt]().for_tools(TOOLS)
    for key, text, typed, _ in VALUES:
        assert _args(parser, WRITE[fmt]([(key, text)])) == {key: typed}, (key, text)
    several = [("path", "123"), ("count", "7"), ("force", "true"), ("items", "[1, 2]"), ("opts", "{'a': True}")]
    assert _args(parser, WRITE[fmt](several)) == {"path": "123", "count": 7, "force": True, "items": [1, 2], "opts": {"a": True}}


@pytest.mark.parametrize("fmt", sorted(WRITE))
def test_without_schemas_values_read_as_json(fmt):
    """No tools bound, or a tool the request did not send: JSON when the text reads as JSON."""
    bare, bound = TOOL_PARSERS[fmt](), TOOL_PARSERS[fmt]().for_tools(TOOLS)
    for key, text, _, untyped in VALUES:
        assert _args(bare, WRITE[fmt]([(key, text)])) == {key: untyped}, (key, text)
        parsed = bound.parse(WRITE[fmt]([(key, text)], name="other"))
        assert json.loads(parsed.calls[0].arguments) == {key: untyped}, (key, text)


def test_binding_is_per_request_and_reaches_through_reasoning():
    shared = TOOL_PARSERS["qwen3_coder"]()
    bound = bound_parser(shared, TOOLS)
    assert bound is not shared and shared.schemas == {} and bound.schemas["edit"]["path"] == {"type": "string"}
    assert bound_parser(shared, True) is shared and bound_parser(shared, None) is shared
    for json_args in (TOOL_PARSERS["hermes"](), TOOL_PARSERS["deepseek_v31"]()):  # JSON arguments: nothing to type
        assert bound_parser(json_args, TOOLS) is json_args
    parser = output_parser(bound, REASONING["qwen3"], True)
    text = "<think>a file named 123</think>" + _qwen([("path", "123"), ("count", "3")])
    parsed = parser.parse(text)
    assert parsed.reasoning == "a file named 123"
    assert json.loads(parsed.calls[0].arguments) == {"path": "123", "count": 3}
    assert _streamed(parser, text) == [(c.name, c.arguments) for c in parsed.calls]


def test_schema_types():
    assert schema_types({"type": "string"}) == ["string"] and schema_types({}) == [] and schema_types(None) == []
    assert schema_types({"type": ["integer", "null"]}) == ["integer", "null"]
    assert schema_types({"oneOf": [{"type": "boolean"}, {"anyOf": [{"type": "array"}]}]}) == ["boolean", "array"]
    assert schema_types({"enum": ["a", "b"]}) == ["string"] and schema_types({"enum": ["a", 1]}) == []
    assert param_value("\n5\n", {"type": "int"}) == 5 and param_value("\n5\n", {"type": "str"}) == "5"


def test_dsml_string_attribute_types_what_the_schema_does_not():
    """DeepSeek V3.2 / V4: ``string="true"`` is a string, ``string="false"`` JSON, unless the schema types the parameter."""
    def call(*params) -> str:
        body = "".join(f'<｜DSML｜parameter name="{k}" string="{kind}">{v}</｜DSML｜parameter>\n' for k, kind, v in params)
        return f'Sure.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="edit">\n{body}</｜DSML｜invoke>\n</｜DSML｜function_calls>'

    text = call(("path", "false", "123"), ("count", "true", "7"), ("loose", "true", "12"), ("maybe", "false", "[1]"),
                ("other", "false", "[1]"), ("note", "true", "\nline\n"))
    bound, bare = TOOL_PARSERS["deepseek_v32"]().for_tools(TOOLS), TOOL_PARSERS["deepseek_v32"]()
    assert _args(bound, text) == {"path": "123", "count": 7, "loose": "12", "maybe": "[1]", "other": [1], "note": "\nline\n"}
    assert _args(bare, text) == {"path": 123, "count": "7", "loose": "12", "maybe": [1], "other": [1], "note": "\nline\n"}
