"""Tool-call and reasoning formats (quanta.server.tool_formats) against llama.cpp's test-chat.cpp.

Each case's input and expected result are copied from ``tests/test-chat.cpp``
of the llama.cpp tree that tests/llama_cpp_material.py downloads; the comment
on each names the template block (and its line in that file) it comes from.
Contents and reasoning are compared without surrounding whitespace (llama.cpp
keeps a newline before a call that quanta drops), arguments as JSON values.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest

from llama_cpp_material import chat_templates, llama_cpp_tree
from quanta.server.tool_formats.reasoning import REASONING
from quanta.server.tool_formats.registry import (
    TOOL_PARSERS,
    choose_parser,
    choose_reasoning,
    detect,
    output_parser,
    reasoning_name,
    tool_parser_name,
)
from quanta.server.tool_formats.stream import ArgumentsDelta, CallClosed, CallOpened, ReasoningDelta, TextDelta

SPECIAL = [("special_function", {"arg1": 1})]
HELLO = "Hello, world!\nWhat's up?"


@dataclass
class Case:
    where: str  # the test-chat.cpp block it comes from
    tool: str
    text: str
    content: str | None = None
    calls: list = field(default_factory=list)
    reasoning: str | None = None
    think: str | None = None  # reasoning parser
    opened: bool = False  # the prompt ends inside the reasoning (enable_thinking / forced-open templates)
    ids: list | None = None  # call ids the model wrote


DS_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
           "```json\n{\"arg1\": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
QWEN_CALL = "<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>"
QWEN_OPT = ("<tool_call>\n<function=special_function_with_opt>\n<parameter=arg1>\n1\n</parameter>\n"
            "<parameter=arg2>\n2\n</parameter>\n</function>\n</tool_call>")
TWO = [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]



def _dsml(block: str, *calls) -> str:
    """DeepSeek V3.2 / V4 calls (name, ((key, string attribute, text), ...)) as test-chat.cpp writes them."""
    invokes = "".join(f'<｜DSML｜invoke name="{name}">\n' + "".join(
        f'<｜DSML｜parameter name="{k}" string="{kind}">{v}</｜DSML｜parameter>\n' for k, kind, v in params)
        + "</｜DSML｜invoke>\n" for name, params in calls)
    return f"<｜DSML｜{block}>\n{invokes}</｜DSML｜{block}>"


DSML_SPECIAL = ("special_function", (("arg1", "false", "1"),))
DSML_PARIS = (("get_time", (("city", "true", "Paris"),)), ("get_weather", (("city", "true", "Paris"),)))
DSML_MULTI = ("magic_int", (("ref", "false", "42"), ("name", "true", "foo bar")))
PARIS = [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris"})]
V32_CASES = [
    # DeepSeek V3.2 (test-chat.cpp ~4004-4180): DSML; thinking enabled where the prompt ends with <think>
    Case("DeepSeek-V3.2", "deepseek_v32", HELLO, HELLO, think="deepseek_r1"),
    Case("DeepSeek-V3.2", "deepseek_v32", "I'm\nthinking</think>" + HELLO, HELLO, reasoning="I'm\nthinking",
         think="deepseek_r1", opened=True),
    Case("DeepSeek-V3.2", "deepseek_v32", "Let me check the time</think>\n\n" + _dsml("function_calls", ("get_time", (
         ("city", "true", "Tokyo"),))), calls=[("get_time", {"city": "Tokyo"})], reasoning="Let me check the time",
         think="deepseek_r1", opened=True),
    Case("DeepSeek-V3.2", "deepseek_v32", _dsml("function_calls", DSML_SPECIAL), calls=SPECIAL, think="deepseek_r1"),
    Case("DeepSeek-V3.2", "deepseek_v32", "Calling both</think>\n\n" + _dsml("function_calls", *DSML_PARIS),
         calls=PARIS, reasoning="Calling both", think="deepseek_r1", opened=True),
    Case("DeepSeek-V3.2", "deepseek_v32", "Thinking about it</think>Let me call the function.\n\n"
         + _dsml("function_calls", DSML_SPECIAL), "Let me call the function.", SPECIAL, "Thinking about it", "deepseek_r1", True),
    *[Case("DeepSeek-V3.2", "deepseek_v32", "Test</think>\n\n" + _dsml("function_calls", (name, ((key, "false", text),))),
           calls=[(name, {key: value})], reasoning="Test", think="deepseek_r1", opened=True) for name, key, text, value in (
        ("magic_int", "ref", "-14", -14), ("amount", "orig", "3.14", 3.14), ("toggle", "enabled", "true", True),
        ("todo_list", "todos", '["buy milk","walk dog"]', ["buy milk", "walk dog"]),
        ("set_config", "config", '{"theme":"dark","level":2}', {"theme": "dark", "level": 2}))],
    Case("DeepSeek-V3.2", "deepseek_v32", "</think>\n\n" + _dsml("function_calls", ("get_time", (("city", "true", "XYZCITY"),))),
         calls=[("get_time", {"city": "XYZCITY"})], think="deepseek_r1", opened=True),
    Case("DeepSeek-V3.2", "deepseek_v32", "Multi-arg call</think>\n\n" + _dsml("function_calls", DSML_MULTI),
         calls=[("magic_int", {"ref": 42, "name": "foo bar"})], reasoning="Multi-arg call", think="deepseek_r1", opened=True),
]

CASES = [
    # NousResearch-Hermes-2-Pro (test-chat.cpp ~3330)
    Case("Hermes-2-Pro", "hermes", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>', calls=SPECIAL),
    Case("Hermes-2-Pro", "hermes", HELLO + '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>',
         HELLO, SPECIAL),
    # MiMo-VL / Hermes 3 / Qwen 2.5 (~6103)
    Case("Qwen2.5", "hermes", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>', calls=SPECIAL),
    Case("Qwen2.5", "hermes", HELLO, HELLO),
    # Qwen-QwQ-32B, forced-open thinking (~3296)
    Case("QwQ", "hermes", "Let me think about this...\n</think>\nThe answer is 42.", "The answer is 42.",
         reasoning="Let me think about this...", think="qwen3", opened=True),
    Case("QwQ", "hermes", "</think>Hello, world!", "Hello, world!", think="qwen3", opened=True),
    # Qwen3-Coder (~3552)
    Case("Qwen3-Coder", "qwen3_coder", "<tool_call>\n" + QWEN_CALL, calls=SPECIAL),
    Case("Qwen3-Coder, no opening <tool_call>", "qwen3_coder", QWEN_CALL, calls=SPECIAL),
    Case("Qwen3-Coder", "qwen3_coder", "Let me call it.\n" + QWEN_CALL, "Let me call it.", SPECIAL),
    Case("Qwen3-Coder, parallel", "qwen3_coder", QWEN_CALL + "\n" + QWEN_OPT, calls=TWO),
    Case("Qwen3-Coder, parallel", "qwen3_coder", "<tool_call>\n" + QWEN_CALL + "\n" + QWEN_OPT, calls=TWO),
    # DeepSeek V3.1 (~3919-3990), thinking enabled: the prompt ends with <think>
    Case("DeepSeek-V3.1", "deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"city\": "
         "\"XYZCITY\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", calls=[("get_time", {"city": "XYZCITY"})], think="deepseek_r1"),
    Case("DeepSeek-V3.1", "deepseek_v31", "REASONING</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
         "{\"city\": \"Tokyo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", calls=[("get_time", {"city": "Tokyo"})],
         reasoning="REASONING", think="deepseek_r1", opened=True),
    Case("DeepSeek-V3.1", "deepseek_v31", "REASONING</think>CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
         "{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": "
         "\"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "CONTENT",
         [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris"})], "REASONING", "deepseek_r1", True),
    Case("DeepSeek-V3.1", "deepseek_v31", "REASONING</think>\nCONTENT", "CONTENT", reasoning="REASONING",
         think="deepseek_r1", opened=True),
    Case("DeepSeek-V3.1", "deepseek_v31", "CONTENT", "CONTENT", think="deepseek_r1"),
    # DeepSeek R1 distills and llama.cpp's R1 template (~5989-6100)
    Case("R1-Distill-Llama", "deepseek_v3", "</think>" + HELLO, HELLO, think="deepseek_r1", opened=True),
    Case("R1-Distill-Llama", "deepseek_v3", "I'm\nthinking</think>" + HELLO, HELLO, reasoning="I'm\nthinking",
         think="deepseek_r1", opened=True),
    Case("llama-cpp-deepseek-r1", "deepseek_v3", "</think>" + DS_CALL, calls=SPECIAL, think="deepseek_r1", opened=True),
    Case("R1-Distill-Qwen", "deepseek_v3", DS_CALL, calls=SPECIAL, think="deepseek_r1"),
    # GLM-4.6 and GLM-4.7-Flash (~4388-4440)
    Case("GLM-4.6", "glm45", "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
         calls=SPECIAL),
    Case("GLM-4.7-Flash", "glm45", HELLO, HELLO, think="glm45"),
    Case("GLM-4.7-Flash", "glm45", "I'm\nthinking</think>" + HELLO, HELLO, reasoning="I'm\nthinking", think="glm45", opened=True),
    Case("GLM-4.7-Flash", "glm45", "<tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value></tool_call>",
         calls=SPECIAL, think="glm45"),
    Case("GLM-4.7-Flash", "glm45", "I'm\nthinking</think><tool_call>special_function<arg_key>arg1</arg_key>"
         "<arg_value>1</arg_value></tool_call>", calls=SPECIAL, reasoning="I'm\nthinking", think="glm45", opened=True),
    # Kimi-K2 and Kimi-K2-Instruct (~5184)
    Case("Kimi-K2", "kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.special_function:0"
         "<|tool_call_argument_begin|>{\"arg1\": 1}<|tool_call_end|><|tool_calls_section_end|>", calls=SPECIAL,
         ids=["functions.special_function:0"]),
    Case("Kimi-K2", "kimi_k2", HELLO, HELLO),
    # Mistral Nemo (~5915), Mistral Small 3.2 (~6252), Devstral (~6283)
    Case("Mistral-Nemo", "mistral", '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]',
         calls=SPECIAL, ids=["123456789"]),
    Case("Mistral-Small-3.2", "mistral", '[TOOL_CALLS]special_function[CALL_ID]123456789[ARGS]{"arg1": 1}', calls=SPECIAL,
         ids=["123456789"]),
    Case("Mistral-Small-3.2", "mistral", '[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]{"arg1": 1}'
         '[TOOL_CALLS]special_function_with_opt[CALL_ID]000000002[ARGS]{"arg1": 1, "arg2": 2}', calls=TWO,
         ids=["000000001", "000000002"]),
    Case("Devstral", "mistral", '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}', calls=SPECIAL),
    Case("Devstral", "mistral", HELLO + '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}', HELLO, SPECIAL),
    # Functionary v3.1 (~5932), FireFunction v2 (~5969)
    Case("functionary-v3.1", "functionary", '<function=special_function>{"arg1": 1}</function>', calls=SPECIAL),
    Case("firefunction-v2", "firefunction", ' functools[{"name": "special_function", "arguments": {"arg1": 1}}]', calls=SPECIAL),
    # Command R7B (~5878) and Command R+ (~5892)
    Case("command-r7b", "command_r", "<|START_RESPONSE|>" + HELLO + "<|END_RESPONSE|>", HELLO),
    Case("command-r7b", "command_r", "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_ACTION|>[\n"
         '    {"tool_call_id": "0", "tool_name": "special_function", "parameters": {"arg1": 1}}\n]<|END_ACTION|>',
         calls=SPECIAL, reasoning="I'm\nthinking", think="command_r", ids=["0"]),
    Case("command-r-plus", "command_r", 'Action:\n```json\n[{"tool_name": "special_function", "parameters": {"arg1": 1}}]\n```',
         calls=SPECIAL),
    # Granite 3.3 (~3367) and 4.0 (~3407)
    Case("granite-3.3", "granite", "<think>I'm\nthinking</think>" + HELLO, HELLO, reasoning="I'm\nthinking", think="granite"),
    Case("granite-4.0", "hermes", '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
         calls=SPECIAL),
    # Llama 3.1 / 3.2 / 3.3 (~6299): test-chat.cpp has content cases only for them
    Case("Llama-3.1", "llama3_json", HELLO, HELLO),
    # gpt-oss harmony (~6425)
    Case("gpt-oss final", "openai", "<|channel|>final<|message|>" + HELLO, HELLO),
    Case("gpt-oss commentary", "openai", "<|channel|>commentary<|message|>" + HELLO, HELLO),
    Case("gpt-oss analysis+final", "openai", "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant"
         "<|channel|>final<|message|>" + HELLO, HELLO, reasoning="I'm\nthinking"),
    Case("gpt-oss partial analysis", "openai", "<|channel|>analysis<|message|>I'm\nthinking", reasoning="I'm\nthinking"),
    Case("gpt-oss recipient in role", "openai", ' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}',
         calls=SPECIAL),
    Case("gpt-oss recipient in channel", "openai", '<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}',
         calls=SPECIAL),
    Case("gpt-oss constrain", "openai", ' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>'
         '{"arg1": 1}', calls=SPECIAL),
    Case("gpt-oss commentary call", "openai", '<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}',
         calls=SPECIAL),
    Case("gpt-oss reasoning then call", "openai", "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant "
         'to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', calls=SPECIAL, reasoning="I'm\nthinking"),
    Case("gpt-oss complex call", "openai", "<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant"
         "<|channel|>commentary to=functions.edit <|constrain|>json<|message|>"
         '{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", "replaceAll": false}',
         calls=[("edit", {"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", "replaceAll": False})],
         reasoning="Thinking about edit..."),
    *V32_CASES,
    # DeepSeek V4 (~4233-4330): V3.2's cases but the typed values and the empty reasoning, the block named tool_calls
    *[dataclasses.replace(c, where="DeepSeek-V4", tool="deepseek_v4", text=c.text.replace("function_calls", "tool_calls"))
      for c in V32_CASES if "Test</think>" not in c.text and "XYZCITY" not in c.text],
]


def _parser(case: Case):
    syntax = REASONING[case.think] if case.think else None
    return output_parser(TOOL_PARSERS[case.tool](), syntax, True, case.opened)


def _strip(text: str | None) -> str | None:
    return text.strip() or None if text else None


def _calls(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(parser, text: str, size: int = 1):
    """(content, reasoning, calls) from feeding ``text`` in ``size``-character pieces; checks the events' order."""
    stream = parser.stream()
    events = []
    for i in range(0, len(text), size):
        events += stream.feed(text[i:i + size])
    events += stream.finish()
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    opened = [e for e in events if isinstance(e, CallOpened)]
    closed = [e.call for e in events if isinstance(e, CallClosed)]
    for e in opened:  # each call's fragments concatenate to its arguments
        fragments = "".join(a.text for a in events if isinstance(a, ArgumentsDelta) and a.index == e.index)
        assert fragments == closed[e.index].arguments
    return content or None, reasoning or None, closed


@pytest.mark.parametrize("case", CASES, ids=[f"{c.where}:{i}" for i, c in enumerate(CASES)])
def test_llama_cpp_case_whole_and_streamed(case: Case):
    parser = _parser(case)
    parsed = parser.parse(case.text)
    assert _strip(parsed.content) == _strip(case.content)
    assert _strip(parsed.reasoning) == _strip(case.reasoning)
    assert _calls(parsed.calls) == case.calls and parsed.made_calls == bool(case.calls)
    if case.ids is not None:
        assert [c.id for c in parsed.calls] == case.ids
    for size in (1, 3):
        content, reasoning, calls = _streamed(parser, case.text, size)
        assert (content, reasoning) == (parsed.content, parsed.reasoning)
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in parsed.calls]


def test_half_written_call_is_never_content():
    """Until a call's marker can be told apart, nothing of it is sent as text."""
    parser = TOOL_PARSERS["deepseek_v31"]()
    stream = parser.stream()
    events = []
    for ch in "Sure.<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"city\": ":
        events += stream.feed(ch)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Sure."
    assert [e.name for e in events if isinstance(e, CallOpened)] == ["get_time"]
    assert "".join(e.text for e in events if isinstance(e, ArgumentsDelta)) == '{"city": '
    events = stream.finish()
    assert [e.complete for e in events if isinstance(e, CallClosed)] == [False] and not stream.made_calls
    whole = parser.parse("Sure.<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"city\": ")
    assert whole.calls == [] and whole.broken and whole.content.startswith("Sure.<｜tool▁call▁begin｜>")


@pytest.mark.parametrize("name,text", [
    ("qwen3_coder", "a <function=x and more"), ("glm45", "<tool_call>not a name\n"), ("mistral", "[TOOL_CALLS] no"),
    ("openai", "<|channel|"), ("deepseek_v31", "<｜tool▁call▁begin｜>f<｜tool▁sep｜>not json"),
    ("kimi_k2", "<|tool_call_begin|>functions.f:0"), ("command_r", "<|START_ACTION|>[1, 2]"),
    ("deepseek_v32", '<｜DSML｜invoke name="two words">'), ("deepseek_v4", '<｜DSML｜invoke name="f'),
])
def test_marker_without_a_call_stays_content(name, text):
    parser = TOOL_PARSERS[name]()
    parsed = parser.parse(text)
    assert parsed.calls == [] and _strip(parsed.content) == text.strip()
    assert _streamed(parser, text)[0] == parsed.content


# --- detection: the parser each llama.cpp template gets (the formats test-chat.cpp gives them) ---
EXPECTED = {
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": ("hermes", None),
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", None),
    "Qwen-Qwen3-0.6B": ("hermes", "deepseek_r1"),
    "Qwen-QwQ-32B": ("hermes", "deepseek_r1"),
    "Qwen3-Coder": ("qwen3_coder", None),
    "Qwen3.5-4B": ("qwen3_coder", "deepseek_r1"),
    "deepseek-ai-DeepSeek-V3.1": ("deepseek_v31", "deepseek_r1"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("deepseek_v3", "deepseek_r1"),
    "llama-cpp-deepseek-r1": ("deepseek_v3", "deepseek_r1"),
    "GLM-4.6": ("glm45", "deepseek_r1"),
    "GLM-4.7-Flash": ("glm45", "deepseek_r1"),
    "moonshotai-Kimi-K2": ("kimi_k2", None),
    "Kimi-K2-Thinking": ("kimi_k2", "deepseek_r1"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", None),
    "Mistral-Small-3.2-24B-Instruct-2506": ("mistral", None),
    "mistralai-Ministral-3-14B-Reasoning-2512": ("mistral", "mistral"),
    "unsloth-mistral-Devstral-Small-2507": ("mistral", None),
    "meetkai-functionary-medium-v3.1": ("functionary", None),
    "fireworks-ai-llama-3-firefunction-v2": ("firefunction", None),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": ("command_r", "command_r"),
    "CohereForAI-c4ai-command-r-plus-tool_use": ("command_r", None),
    "ibm-granite-granite-3.3-2B-Instruct": ("granite", "deepseek_r1"),
    "ibm-granite-granite-4.0": ("hermes", None),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3_json", None),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama3_json", None),
    "meta-llama-Llama-3.3-70B-Instruct": ("llama3_json", None),
    "openai-gpt-oss-120b": ("openai", "openai"),
    "ByteDance-Seed-OSS": ("qwen3_coder", "seed_oss"),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": ("qwen3_coder", "deepseek_r1"),
    "google-gemma-2-2b-it": ("hermes", None),  # no tool syntax: the Hermes fallback prompt
    "deepseek-ai-DeepSeek-V3.2": ("deepseek_v32", "deepseek_r1"),
    "deepseek-ai-DeepSeek-V4": ("deepseek_v4", "deepseek_r1"),
    "deepseek-ai-DeepSeek-V4-Flash-0731": ("deepseek_v4", "deepseek_r1"),
}


def test_detection_of_each_llama_cpp_template():
    templates = {p.stem: p.read_text() for p in chat_templates()}
    if not templates:
        llama_cpp_tree()  # skips with the reason
    assert set(EXPECTED) <= set(templates)
    for stem, text in templates.items():
        tool, reasoning = detect(text)
        assert tool in TOOL_PARSERS and (reasoning is None or reasoning in REASONING or reasoning == "openai")
        if stem in EXPECTED:
            assert (tool, reasoning) == EXPECTED[stem], stem


def test_names_and_overrides():
    assert tool_parser_name("qwen3_xml") == "qwen3_coder" and choose_parser("<tool_call>", "kimi_k2").name == "kimi_k2"
    assert choose_reasoning("<think>", "none") is None and choose_reasoning("<think>").start == "<think>"
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; choose one of: "):
        tool_parser_name("nope")
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        reasoning_name("nope")


# --- round trip: parse a test-chat.cpp output, render the calls with the model's template, parse again ---
#: end-of-turn markers: the engine stops at them, so a model's output never holds them
TURN_ENDS = ("</s>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<｜end▁of▁sentence｜>", "<|call|>", "<|END_OF_TURN_TOKEN|>")
ROUND_TRIP = [  # (template, index of a case above whose calls are rendered)
    ("Qwen-Qwen2.5-7B-Instruct", 2), ("Qwen3-Coder", 9), ("deepseek-ai-DeepSeek-V3.1", 13), ("GLM-4.6", 20),
    ("moonshotai-Kimi-K2", 25), ("mistralai-Mistral-Nemo-Instruct-2407", 27), ("Mistral-Small-3.2-24B-Instruct-2506", 29),
    ("unsloth-mistral-Devstral-Small-2507", 30), ("meetkai-functionary-medium-v3.1", 32),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", 35), ("openai-gpt-oss-120b", 48),
    ("meta-llama-Llama-3.1-8B-Instruct", 2),  # the Qwen2.5 case's call: test-chat.cpp has no Llama 3 call
    *[(stem, next(i for i, c in enumerate(CASES) if c.tool == tool and c.calls == PARIS)) for stem, tool in (
        ("deepseek-ai-DeepSeek-V3.2", "deepseek_v32"), ("deepseek-ai-DeepSeek-V4", "deepseek_v4"))],
]
TOOLS = [{"type": "function", "function": {"name": name, "description": name, "parameters": {
    "type": "object", "properties": {k: {"type": "integer"} for k in ("arg1", "arg2", "city")}}}}
    for name in ("special_function", "special_function_with_opt", "get_time", "get_weather")]


#: templates whose generation prompt opens the turn as its assistant turn does only with thinking on
#: (without it, DeepSeek V3.2 prompts ``<think></think>`` and writes the turn after ``</think>``)
THINKING = {"deepseek-ai-DeepSeek-V3.2", "deepseek-ai-DeepSeek-V4"}


def _assistant_text(template: str, calls, thinking: bool = False) -> str:
    """What the template writes for an assistant turn with ``calls`` (after the generation prompt, up to its end marker)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(msgs, gen):
        out, _ = render_jinja_template(conversations=[msgs], tools=TOOLS, chat_template=template, add_generation_prompt=gen,
                                       bos_token="<s>", eos_token="</s>", **({"thinking": True} if thinking else {}))
        return out[0]

    user = [{"role": "user", "content": "Hi"}]
    tool_calls = [{"id": c.id if c.id.isalnum() and len(c.id) == 9 else "123456789", "type": "function",
                   "function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in calls]
    prefix, full = render(user, True), render(user + [{"role": "assistant", "content": "", "tool_calls": tool_calls}], False)
    assert full.startswith(prefix)
    tail = full[len(prefix):]
    ends = [i for i in (tail.find(m) for m in TURN_ENDS) if i >= 0]
    return tail[:min(ends)] if ends else tail


@pytest.mark.parametrize("stem,index", ROUND_TRIP)
def test_calls_round_trip_through_the_template(stem, index):
    template = next((p.read_text() for p in chat_templates() if p.stem == stem), None)
    if template is None:
        llama_cpp_tree()
        pytest.skip(f"{stem} not in this llama.cpp tree")
    case = CASES[index]
    calls = _parser(case).parse(case.text).calls
    assert calls, case.where
    tool, reasoning = detect(template)
    assert (tool, reasoning) == EXPECTED[stem]
    thinking = stem in THINKING
    parser = output_parser(TOOL_PARSERS[tool](), REASONING.get(reasoning) if reasoning else None, True, thinking)
    again = parser.parse(_assistant_text(template, calls, thinking))
    assert _calls(again.calls) == _calls(calls)


@pytest.mark.parametrize(("tool", "text"), [
    ("kimi_k2", "<|tool_calls_section_begin|>" + "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": 1}"
     "<|tool_call_end|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": 2}<|tool_call_end|>"
     "<|tool_calls_section_end|>"),
    ("command_r", '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "parameters": {"a": 1}}, '
     '{"tool_call_id": "0", "tool_name": "f", "parameters": {"a": 2}}]<|END_ACTION|>'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "id": "abcdefghi"}, '
     '{"name": "f", "arguments": {"a": 2}, "id": "abcdefghi"}]'),
])
def test_an_id_the_model_repeats_is_replaced_whole_and_streamed(tool, text):
    """A client matches each tool result to its call by id: two calls of one output never share one."""
    parser = TOOL_PARSERS[tool]()
    parsed = parser.parse(text)
    assert _calls(parsed.calls) == [("f", {"a": 1}), ("f", {"a": 2})]
    first, second = (c.id for c in parsed.calls)
    assert second != first and first in text  # the first keeps the model's id
    for size in (1, 5):
        stream = parser.stream()
        events = [e for i in range(0, len(text), size) for e in stream.feed(text[i:i + size])] + stream.finish()
        ids = [e.id for e in events if isinstance(e, CallOpened)]
        assert len(ids) == 2 and ids[0] == first and ids[1] != first, ids
