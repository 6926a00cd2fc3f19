"""The marker-delimited call formats, one :class:`Syntax` each (read by :mod:`.marked`).

- ``deepseek_v3`` (DeepSeek V3, R1 and its distills):
  ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``;
- ``deepseek_v31`` (DeepSeek V3.1): ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``;
- ``deepseek_v32`` (DeepSeek V3.2's DSML): ``<｜DSML｜function_calls>\n<｜DSML｜invoke name="NAME">\n``
  ``<｜DSML｜parameter name="k" string="true">v</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>``
  (``string="false"``: the value is JSON; the request's schema wins where it types the parameter);
  ``deepseek_v4`` (DeepSeek V4): the same, the block named ``tool_calls``;
- ``kimi_k2``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>...``
  (the call's id is ``functions.NAME:0`` as written);
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5, Nemotron 3, StepFun 3.5):
  ``<tool_call>\\n<function=NAME>\\n<parameter=k>\\nv\\n</parameter>\\n</function>\\n</tool_call>``
  (the first ``<tool_call>`` may be missing; Seed-OSS wraps calls in ``<seed:tool_call>``);
- ``glm45`` (GLM-4.5/4.6/4.7, Laguna, Ling):
  ``<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>``;
- ``functionary`` (Functionary v3.1): ``<function=NAME>{...}</function>``;
- ``granite`` (Granite 3.x): ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``;
- ``command_r`` (Command R7B, Command A): ``<|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters": {...}}]<|END_ACTION|>``,
  content in ``<|START_RESPONSE|>...<|END_RESPONSE|>``; Command R+: ``Action:\\n```json\\n[...]\\n```"``;
- ``firefunction`` (FireFunction v2): `` functools[{"name": ..., "arguments": {...}}]``.
"""

from __future__ import annotations

from quanta.server.tool_formats.marked import MarkedParser, Syntax
from quanta.server.tool_formats.params import ParamSyntax

DS_CALLS, DS_CALL, DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
DS_CLOSERS = ("<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")


def _deepseek_v3_name(raw: str) -> tuple[str, str | None]:
    kind, sep, name = raw.partition(DS_SEP)
    return (name if sep else kind).strip(), None


def _kimi_name(raw: str) -> tuple[str, str | None]:
    call_id = raw.strip()
    return call_id.rsplit(":", 1)[0].removeprefix("functions."), call_id


class DeepSeekV3Parser(MarkedParser):
    name = "deepseek_v3"
    syntax = Syntax(begins=(DS_CALL,), drops=(DS_CALLS,), name_ends=("```json",),
                    closers=("```", *DS_CLOSERS), name_of=_deepseek_v3_name)
    inner_markers = (DS_SEP,)


class DeepSeekV31Parser(MarkedParser):
    name = "deepseek_v31"
    syntax = Syntax(begins=(DS_CALL,), drops=(DS_CALLS,), name_ends=(DS_SEP,), closers=DS_CLOSERS)


DSML = "｜DSML｜"
DSML_PARAMS = ParamSyntax(f'<{DSML}parameter name="', '"', "", f"</{DSML}parameter>", f"</{DSML}invoke>",
                          typed_opens=(('string="true">', {"type": "string"}), ('string="false">', None)), trim=False)


def dsml_syntax(block: str) -> Syntax:
    """DeepSeek's DSML calls inside a ``<｜DSML｜BLOCK>`` block."""
    return Syntax(begins=(f'<{DSML}invoke name="',), drops=(f"<{DSML}{block}>",), name_ends=('">',),
                  closers=(f"</{DSML}{block}>",), params=DSML_PARAMS)


class DeepSeekV32Parser(MarkedParser):
    name = "deepseek_v32"
    syntax = dsml_syntax("function_calls")
    inner_markers = (DSML,)


class DeepSeekV4Parser(MarkedParser):
    name = "deepseek_v4"
    syntax = dsml_syntax("tool_calls")
    inner_markers = (DSML,)


class KimiK2Parser(MarkedParser):
    name = "kimi_k2"
    syntax = Syntax(begins=("<|tool_call_begin|>",), drops=("<|tool_calls_section_begin|>",),
                    name_ends=("<|tool_call_argument_begin|>",),
                    closers=("<|tool_call_end|>", "<|tool_calls_section_end|>"), name_of=_kimi_name)


class Qwen3CoderParser(MarkedParser):
    name = "qwen3_coder"
    syntax = Syntax(begins=("<function=",), drops=("<tool_call>", "<seed:tool_call>"), name_ends=(">",),
                    closers=("</tool_call>", "</seed:tool_call>"),
                    params=ParamSyntax("<parameter=", ">", "", "</parameter>", "</function>"))


class Glm45Parser(MarkedParser):
    name = "glm45"
    syntax = Syntax(begins=("<tool_call>",), name_ends=("\n", "<arg_key>", "</tool_call>"),
                    params=ParamSyntax("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "</tool_call>"))


class FunctionaryParser(MarkedParser):
    name = "functionary"
    syntax = Syntax(begins=("<function=",), name_ends=(">",), closers=("</function>",))


class GraniteParser(MarkedParser):
    name = "granite"
    syntax = Syntax(begins=("<|tool_call|>",), arrays=True, named=False)


class CommandRParser(MarkedParser):
    name = "command_r"
    syntax = Syntax(begins=("<|START_ACTION|>", "Action:\n```json"), arrays=True, named=False,
                    drops=("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
                    closers=("<|END_ACTION|>", "```"))


class FireFunctionParser(MarkedParser):
    name = "firefunction"
    syntax = Syntax(begins=("functools",), arrays=True, named=False)


FAMILIES = (DeepSeekV3Parser, DeepSeekV31Parser, DeepSeekV32Parser, DeepSeekV4Parser, KimiK2Parser, Qwen3CoderParser, Glm45Parser,
            FunctionaryParser, GraniteParser, CommandRParser, FireFunctionParser)
