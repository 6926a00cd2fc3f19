"""Forced tool calls (``tool_choice`` ``required`` or a named function): each format's call syntax as a grammar.

:data:`FORCED` maps a format's name to the start expression of a grammar
whose every match is one call of ``tools`` in that format, or one or more
when ``parallel`` (then separated as the model's template separates them),
and nothing else. Markers are written as :class:`.lark.Marks` says (special
tokens as tokens). JSON arguments follow each tool's ``parameters`` schema;
XML-like parameters (Qwen3-Coder, GLM) come in the schema's property order,
the required ones always, a ``string`` (or untyped) value as free text up to
its closing marker, any other value as JSON of its schema.

What each writes (``NAME`` one of the tools, ``{...}`` its arguments):

- ``hermes``: ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`` (calls joined by ``\\n``);
- ``llama3_json``: ``{"name": NAME, "parameters": {...}}`` (joined by ``; ``);
- ``mistral``: ``[TOOL_CALLS][{"name": NAME, "arguments": {...}}]``, or where ``[ARGS]`` is a
  special token (v11 tekken vocabularies) ``[TOOL_CALLS]NAME[ARGS]{...}`` per call;
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``
  then ``<｜tool▁calls▁end｜>``;
- ``deepseek_v31``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜>``;
- ``kimi_k2``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}``
  then ``<|tool_call_end|><|tool_calls_section_end|>``;
- ``qwen3_coder``: ``<tool_call>\\n<function=NAME>\\n<parameter=k>\\nv\\n</parameter>\\n</function>\\n</tool_call>``;
- ``glm45``: ``<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>``;
- ``deepseek_v32``: ``<｜DSML｜function_calls>\\n<｜DSML｜invoke name="NAME">\\n`` then per parameter
  ``<｜DSML｜parameter name="k" string="true">v</｜DSML｜parameter>\\n`` (``string="false"`` and JSON for a
  value that is not plain text), ``</｜DSML｜invoke>\\n``, ``</｜DSML｜function_calls>``; ``deepseek_v4``:
  the same in a ``tool_calls`` block;
- ``functionary``: ``<function=NAME>{...}</function>``;
- ``granite``: ``<|tool_call|>[{"name": NAME, "arguments": {...}}]``;
- ``command_r``: ``<|START_ACTION|>[{"tool_call_id": "0", "tool_name": NAME, "parameters": {...}}]<|END_ACTION|>``;
- ``firefunction``: `` functools[{"name": NAME, "arguments": {...}}]``;
- ``openai`` (gpt-oss harmony): an optional ``<|channel|>analysis<|message|>...<|end|><|start|>assistant``,
  then ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``: one call,
  parallel or not (``<|call|>`` ends the turn; where it is an end-of-sequence token the grammar ends
  before it and the model writes it).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from quanta.server.tool_formats.lark import (
    Lark,
    Marker,
    call_object,
    calls_array,
    regex_literal,
    repeat,
    tool_name,
    tool_params,
)

DSML = "｜DSML｜"
DS_CALLS, DS_CALL, DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
DS_CALL_END, DS_CALLS_END = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"


def _choice(tools: list[dict], one: Callable[[dict], str]) -> str:
    """Any one of the calls ``one`` writes for each tool."""
    return " | ".join(f"({one(t)})" for t in tools)


def _q(text: str) -> str:
    return json.dumps(text)


def hermes(b: Lark, tools: list[dict], parallel: bool) -> str:
    m = b.marks
    objects = [call_object(t) for t in tools]
    body = b.json(objects[0] if len(objects) == 1 else {"anyOf": objects})
    return repeat(f'{m.lit("<tool_call>")} "\\n" {body} "\\n" {m.lit("</tool_call>")}', parallel, "\n")


def llama3_json(b: Lark, tools: list[dict], parallel: bool) -> str:
    objects = [call_object(t, args_key="parameters") for t in tools]
    return repeat(b.json(objects[0] if len(objects) == 1 else {"anyOf": objects}), parallel, "; ")


def mistral(b: Lark, tools: list[dict], parallel: bool) -> str:
    m = b.marks
    if m.has("[ARGS]"):  # v11: [TOOL_CALLS]NAME[ARGS]{...}, one marker per call
        one = _choice(tools, lambda t: f'{_q(tool_name(t))} {m.lit("[ARGS]")} {b.json(tool_params(t))}')
        return repeat(f'{m.lit("[TOOL_CALLS]")} ({one})', parallel)
    return f'{m.lit("[TOOL_CALLS]")} {b.json(calls_array(tools, parallel))}'


def _section(b: Lark, tools: list[dict], parallel: bool, ends: tuple[str, str], call, sep: str = "") -> str:
    """Calls (``call(tool)``: the parts of one, markers as :class:`Marker`) between the two
    section markers ``ends``, joined by ``sep``."""
    one = _choice(tools, lambda t: b.seq(*call(t)))
    return b.seq(Marker(ends[0]), repeat(one, parallel, sep), Marker(ends[1]))


def deepseek_v3(b: Lark, tools: list[dict], parallel: bool) -> str:
    return _section(b, tools, parallel, (DS_CALLS, DS_CALLS_END), lambda t: (
        Marker(DS_CALL), '"function"', Marker(DS_SEP), _q(tool_name(t) + "\n```json\n"), b.json(tool_params(t)),
        '"\\n```"', Marker(DS_CALL_END)), "\n")


def deepseek_v31(b: Lark, tools: list[dict], parallel: bool) -> str:
    return _section(b, tools, parallel, (DS_CALLS, DS_CALLS_END), lambda t: (
        Marker(DS_CALL), _q(tool_name(t)), Marker(DS_SEP), b.json(tool_params(t)), Marker(DS_CALL_END)))


def kimi_k2(b: Lark, tools: list[dict], parallel: bool) -> str:
    return _section(b, tools, parallel, ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"), lambda t: (
        Marker("<|tool_call_begin|>"), _q(f"functions.{tool_name(t)}:"), "/[0-9]{1,3}/",
        Marker("<|tool_call_argument_begin|>"), b.json(tool_params(t)), Marker("<|tool_call_end|>")))


def _free_text(schema) -> bool:
    """Whether a parameter's value is written as plain text (a string, or no type said)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind)


def _value(b: Lark, schema, closer: str, written: str | None = None, until: str | None = None) -> str:
    """A parameter's value, its ``closer`` and a newline: JSON of the schema unless the value is
    plain text (:func:`_free_text`): then one of the schema's ``enum`` strings if it lists only
    strings, else any text up to the first ``closer``. ``written`` / ``until``: the closer, and
    text up to it, where :meth:`Marks.lit` / :meth:`Lark.until` would not write them."""
    written = written or b.marks.lit(closer)
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if not _free_text(schema):
        value = f"{b.json(schema)} {written}"
    elif isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        value = f"({' | '.join(_q(v) for v in enum)}) {written}"
    else:
        value = until or b.until(closer)
    return f'{value} "\\n"'


class UnwritableName(ValueError):
    """A parameter name an XML-like format cannot write: it holds the format's own delimiters."""


#: what an XML-like format's parameter name cannot hold (``<parameter=k>``, ``name="k"``, ``<arg_key>k</arg_key>``)
_NAME_BREAKERS = ("<", ">", '"', "\n")


def _params(tool: dict, one: Callable[[str, dict], str]) -> str:
    """The tool's parameters in schema order (each as ``one`` writes it; optional ones may be left out).

    Raises:
        UnwritableName: a parameter name holds ``<``, ``>``, ``"`` or a line break.
    """
    params = tool_params(tool)
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    for key in props:
        if any(c in key for c in _NAME_BREAKERS):
            raise UnwritableName(f"parameter {key[:80]!r} of tool {tool_name(tool)!r}: a name with <, >, \" or a line "
                                 "break cannot be written in this tool-call format")
    required = set(params.get("required") or [])
    parts = [one(k, s) if k in required else f"({one(k, s)})?" for k, s in props.items()]
    return " ".join(parts)


def qwen3_coder(b: Lark, tools: list[dict], parallel: bool) -> str:
    def param(key: str, schema: dict) -> str:
        return f'{_q(f"<parameter={key}>{chr(10)}")} {_value(b, schema, chr(10) + "</parameter>")}'

    one = _choice(tools, lambda t: f'{_q("<function=" + tool_name(t) + ">" + chr(10))} {_params(t, param)} "</function>\\n"')
    return repeat(f'{b.marks.lit("<tool_call>")} "\\n" ({one}) {b.marks.lit("</tool_call>")}', parallel, "\n")


def glm45(b: Lark, tools: list[dict], parallel: bool) -> str:
    m = b.marks

    def param(key: str, schema: dict) -> str:
        key_text = f'{m.lit("<arg_key>")} {_q(key)} {m.lit("</arg_key>")} "\\n" {m.lit("<arg_value>")}'
        return f'{key_text} {_value(b, schema, "</arg_value>")}'

    one = _choice(tools, lambda t: f'{_q(tool_name(t) + chr(10))} {_params(t, param)}')
    return repeat(f'{m.lit("<tool_call>")} ({one}) {m.lit("</tool_call>")}', parallel, "\n")


def _dsml(b: Lark, text: str) -> str:
    """``text`` with each ``｜DSML｜`` in it written as its token where it is one."""
    out = []
    for i, part in enumerate(text.split(DSML)):
        if i:
            out.append(b.marks.lit(DSML))
        if part:
            out.append(_q(part))
    return " ".join(out)


def _dsml_calls(block: str) -> Callable[[Lark, list[dict], bool], str]:
    """DeepSeek V3.2 (``block`` function_calls) / V4 (tool_calls) DSML calls in one block."""
    def build(b: Lark, tools: list[dict], parallel: bool) -> str:
        closer = f"</{DSML}parameter>"
        # a ｜DSML｜ token is never text: the value is text ending in "</", then the token
        until = f'/(?s:.*{regex_literal("</")})/ {b.marks.lit(DSML)} "parameter>"' if b.marks.has(DSML) else None

        def param(key: str, schema: dict) -> str:
            kind = "true" if _free_text(schema) else "false"
            head = _dsml(b, f'<{DSML}parameter name="{key}" string="{kind}">')
            return f"{head} {_value(b, schema, closer, _dsml(b, closer), until)}"

        def call(tool: dict) -> str:
            head = _dsml(b, f'<{DSML}invoke name="{tool_name(tool)}">\n')
            return f"{head} {_params(tool, param)} {_dsml(b, f'</{DSML}invoke>' + chr(10))}"

        opening, ending = _dsml(b, f"<{DSML}{block}>\n"), _dsml(b, f"</{DSML}{block}>")
        return f"{opening} {repeat(_choice(tools, call), parallel)} {ending}"
    return build


def functionary(b: Lark, tools: list[dict], parallel: bool) -> str:
    one = _choice(tools, lambda t: f'{_q("<function=" + tool_name(t) + ">")} {b.json(tool_params(t))} "</function>"')
    return repeat(one, parallel)


def granite(b: Lark, tools: list[dict], parallel: bool) -> str:
    return f'{b.marks.lit("<|tool_call|>")} {b.json(calls_array(tools, parallel))}'


def command_r(b: Lark, tools: list[dict], parallel: bool) -> str:
    m = b.marks
    ids = {"tool_call_id": {"type": "string", "pattern": "^[0-9]{1,3}$"}}
    array = calls_array(tools, parallel, name_key="tool_name", args_key="parameters", extra=ids)
    return f'{m.lit("<|START_ACTION|>")} {b.json(array)} {m.lit("<|END_ACTION|>")}'


def firefunction(b: Lark, tools: list[dict], parallel: bool) -> str:
    return f'" functools" {b.json(calls_array(tools, parallel))}'


def harmony(b: Lark, tools: list[dict], parallel: bool) -> str:
    m = b.marks
    thought = f'{m.lit("<|channel|>")} "analysis" {m.lit("<|message|>")} {b.until("<|end|>")} {m.lit("<|start|>")} "assistant"'
    end = "" if m.ends_output("<|call|>") else m.lit("<|call|>")
    one = _choice(tools, lambda t: f'{m.lit("<|channel|>")} {_q("commentary to=functions." + tool_name(t) + " ")} '
                                   f'{m.lit("<|constrain|>")} "json" {m.lit("<|message|>")} {b.json(tool_params(t))} {end}')
    return f"({thought})? ({one})"


#: format name -> the start expression of its forced-call grammar
FORCED: dict[str, Callable[[Lark, list[dict], bool], str]] = {
    "hermes": hermes, "llama3_json": llama3_json, "mistral": mistral, "deepseek_v3": deepseek_v3,
    "deepseek_v31": deepseek_v31, "deepseek_v32": _dsml_calls("function_calls"), "deepseek_v4": _dsml_calls("tool_calls"),
    "kimi_k2": kimi_k2, "qwen3_coder": qwen3_coder, "glm45": glm45,
    "functionary": functionary, "granite": granite, "command_r": command_r, "firefunction": firefunction,
    "openai": harmony,
}
