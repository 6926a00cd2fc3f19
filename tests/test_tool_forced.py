"""Forced tool calls in each format's own syntax, and special-token markers kept for the parser.

The grammars are compiled by quanta's GrammarCompiler (llguidance) over the
embedded SmolLM2 tokenizer, once as it is (every marker plain text) and once
with the formats' markers added as special tokens (as gpt-oss, tekken and
DeepSeek vocabularies have them). Each format's grammar must accept the
token ids of a valid call in that syntax (which its parser reads back as
the call), and refuse an invalid one (another syntax, a tool not offered,
arguments off the schema, a second call when one was asked for).
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass

import httpx
import llguidance
import pytest

from llama_cpp_material import llama_cpp_tree
from quanta.engine.grammar import GrammarCompiler
from quanta.engine.sampling import SamplingParams
from quanta.launch import text_state
from quanta.model.loader import embedded_model_path
from quanta.model.tokenizer import Tokenizer
from quanta.server.errors import APIError
from quanta.server.tool_formats.forced import FORCED
from quanta.server.tool_formats.lark import special_markers
from quanta.server.tool_formats.reasoning import REASONING, ReasoningParser
from quanta.server.tool_formats.registry import TOOL_PARSERS, PlainParser, forced_grammar, keeps_specials, parser_params

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ARGS = {"city": "Paris", "days": 2}

DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")


@dataclass
class Form:
    """One format's valid single call (of get_weather with :data:`ARGS`), two calls, and invalid outputs."""

    fmt: str
    one: str
    two: str
    bad: tuple[str, ...]


def _ds3(name: str, args: str) -> str:
    return f"{DS[1]}function{DS[2]}{name}\n```json\n{args}\n```{DS[3]}"


def _ds31(name: str, args: str) -> str:
    return f"{DS[1]}{name}{DS[2]}{args}{DS[3]}"


def _kimi(name: str, args: str, i: int) -> str:
    return f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def _qwen(name: str, params: dict) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _glm(name: str, params: dict) -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in params.items())
    return f"<tool_call>{name}\n{body}</tool_call>"


def _dsml(block: str, *calls: tuple[str, dict], kinds: dict | None = None) -> str:
    """DeepSeek V3.2 / V4 calls in a ``block``; a parameter's string attribute as its value's type
    says (``kinds`` overrides it per key)."""
    def param(k, v):
        kind = (kinds or {}).get(k, "true" if isinstance(v, str) else "false")
        return f'<｜DSML｜parameter name="{k}" string="{kind}">{v if isinstance(v, str) else json.dumps(v)}</｜DSML｜parameter>\n'
    invokes = "".join(f'<｜DSML｜invoke name="{name}">\n' + "".join(param(k, v) for k, v in params.items())
                      + "</｜DSML｜invoke>\n" for name, params in calls)
    return f"<｜DSML｜{block}>\n{invokes}</｜DSML｜{block}>"


A = json.dumps(ARGS, separators=(",", ":"))
T = json.dumps({"zone": "UTC"}, separators=(",", ":"))
W_OBJ = json.dumps({"name": "get_weather", "arguments": ARGS}, separators=(",", ":"))
T_OBJ = json.dumps({"name": "get_time", "arguments": {"zone": "UTC"}}, separators=(",", ":"))
CMD = '{"tool_call_id":"0","tool_name":"get_weather","parameters":' + A + "}"
CMD2 = '{"tool_call_id":"1","tool_name":"get_time","parameters":' + T + "}"
HARMONY = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + A

FORMS = [
    Form("hermes", f"<tool_call>\n{W_OBJ}\n</tool_call>", f"<tool_call>\n{W_OBJ}\n</tool_call>\n<tool_call>\n{T_OBJ}\n</tool_call>",
         (W_OBJ, f"<tool_call>\n{W_OBJ.replace('get_weather', 'get_news')}\n</tool_call>")),
    Form("llama3_json", W_OBJ.replace('"arguments"', '"parameters"'),
         W_OBJ.replace('"arguments"', '"parameters"') + "; " + T_OBJ.replace('"arguments"', '"parameters"'),
         (W_OBJ, "<tool_call>" + W_OBJ)),
    Form("mistral", f"[TOOL_CALLS][{W_OBJ}]", f"[TOOL_CALLS][{W_OBJ},{T_OBJ}]",
         (f"[{W_OBJ}]", f"[TOOL_CALLS]{W_OBJ}")),
    Form("deepseek_v3", f"{DS[0]}{_ds3('get_weather', A)}{DS[4]}",
         f"{DS[0]}{_ds3('get_weather', A)}\n{_ds3('get_time', T)}{DS[4]}",
         (f"{DS[0]}{_ds31('get_weather', A)}{DS[4]}", _ds3("get_weather", A))),
    Form("deepseek_v31", f"{DS[0]}{_ds31('get_weather', A)}{DS[4]}",
         f"{DS[0]}{_ds31('get_weather', A)}{_ds31('get_time', T)}{DS[4]}",
         (f"{DS[0]}{_ds3('get_weather', A)}{DS[4]}", f"{DS[0]}{_ds31('get_weather', '{}')}{DS[4]}")),
    Form("kimi_k2", f"<|tool_calls_section_begin|>{_kimi('get_weather', A, 0)}<|tool_calls_section_end|>",
         f"<|tool_calls_section_begin|>{_kimi('get_weather', A, 0)}{_kimi('get_time', T, 1)}<|tool_calls_section_end|>",
         (_kimi("get_weather", A, 0), f"<|tool_calls_section_begin|>{_kimi('weather', A, 0)}<|tool_calls_section_end|>")),
    Form("qwen3_coder", _qwen("get_weather", {"city": "Paris", "days": 2}),
         _qwen("get_weather", {"city": "Paris", "days": 2}) + "\n" + _qwen("get_time", {"zone": "UTC"}),
         (_qwen("get_weather", {"days": 2}), _qwen("get_weather", {"city": "Paris", "days": "two"}))),
    Form("glm45", _glm("get_weather", {"city": "Paris", "days": 2}),
         _glm("get_weather", {"city": "Paris", "days": 2}) + "\n" + _glm("get_time", {"zone": "UTC"}),
         (_glm("get_weather", {"days": 2}), _qwen("get_weather", {"city": "Paris"}))),
    *[Form(fmt, _dsml(block, ("get_weather", ARGS)), _dsml(block, ("get_weather", ARGS), ("get_time", {"zone": "UTC"})),
           (_dsml(other, ("get_weather", ARGS)), _dsml(block, ("get_weather", ARGS), kinds={"days": "true"}),
            _dsml(block, ("get_weather", {"days": 2}))))
      for fmt, block, other in (("deepseek_v32", "function_calls", "tool_calls"), ("deepseek_v4", "tool_calls", "function_calls"))],
    Form("functionary", f"<function=get_weather>{A}</function>",
         f"<function=get_weather>{A}</function><function=get_time>{T}</function>",
         (f"<function=get_weather>{T}</function>", W_OBJ)),
    Form("granite", f"<|tool_call|>[{W_OBJ}]", f"<|tool_call|>[{W_OBJ},{T_OBJ}]", (f"[{W_OBJ}]", f"<|tool_call|>{W_OBJ}")),
    Form("command_r", f"<|START_ACTION|>[{CMD}]<|END_ACTION|>", f"<|START_ACTION|>[{CMD},{CMD2}]<|END_ACTION|>",
         (f"<|START_ACTION|>[{W_OBJ}]<|END_ACTION|>", f"<|START_ACTION|>[{CMD}]")),
    Form("firefunction", f" functools[{W_OBJ}]", f" functools[{W_OBJ},{T_OBJ}]", (f"[{W_OBJ}]", f" functools{W_OBJ}")),
    Form("openai", HARMONY + "<|call|>", HARMONY + "<|call|>",
         (f"<|channel|>final<|message|>{A}<|call|>", HARMONY.replace("get_weather", "get_news") + "<|call|>")),
]
HARMONY_MARKERS = TOOL_PARSERS["openai"].markers
#: markers that are special tokens in the models' own vocabularies (gpt-oss, DeepSeek, Kimi-K2,
#: Mistral tekken, Llama 3, Granite, Command R7B, GLM-4.5)
SPECIAL_MARKERS = [*HARMONY_MARKERS, *DS, "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                   "<|tool_call_end|>", "<|tool_calls_section_end|>", "[TOOL_CALLS]", "<|python_tag|>", "<|tool_call|>",
                   "<|START_ACTION|>", "<|END_ACTION|>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                   "<arg_value>", "</arg_value>", "｜DSML｜"]


@pytest.fixture(scope="module")
def plain() -> Tokenizer:
    return Tokenizer.from_path(embedded_model_path())


def _with_specials(base: Tokenizer, markers, eos=()) -> Tokenizer:
    """A copy of ``base`` with ``markers`` added as special tokens; ``eos``: those of them that end an output."""
    hf = copy.deepcopy(base.hf)
    hf.add_special_tokens({"additional_special_tokens": list(markers)})
    return Tokenizer(hf, [hf.convert_tokens_to_ids(m) for m in eos])


@pytest.fixture(scope="module")
def special(plain) -> Tokenizer:
    """The embedded tokenizer with the markers that real vocabularies hold as special tokens
    (Mistral's v11 [ARGS] aside: it selects the other syntax, tested apart); <|call|> and
    <|return|> end an output."""
    return _with_specials(plain, SPECIAL_MARKERS, eos=("<|call|>", "<|return|>"))


class Checker:
    """Compiles a format's forced-call grammar over one tokenizer and feeds it token ids."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.compiler = GrammarCompiler(tokenizer.hf, tokenizer.eos_token_ids)

    def accepts(self, parser, text: str, parallel: bool = False, tools=TOOLS) -> bool:
        grammar = parser.grammar(tools, parallel, special_markers(self.tok, tuple(parser.markers)))
        self.compiler.constraint(grammar)  # compiles (GrammarError otherwise)
        ll = self.compiler._tokenizer()
        matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar.lark), log_level=0)
        ids = self.tok.encode(text, add_special_tokens=False)
        if ids[-1] in self.tok.eos_token_ids:  # an end-of-output token: the grammar ends before it, EOS follows
            ids = ids[:-1]
        fed = matcher.try_consume_tokens(ids)
        return fed == len(ids) and matcher.is_accepting() and not matcher.is_error()


@functools.cache
def checker(tokenizer: Tokenizer) -> Checker:
    """One :class:`Checker` per tokenizer (llguidance's vocabulary is built once)."""
    return Checker(tokenizer)


@pytest.mark.parametrize("vocab", ["plain", "special"])
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.fmt)
def test_forced_grammar_accepts_its_own_call_and_refuses_others(form, vocab, request):
    tok = request.getfixturevalue(vocab)
    check = checker(tok)
    parser = TOOL_PARSERS[form.fmt]()
    assert check.accepts(parser, form.one), form.one
    parsed = parser.parse(form.one)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", ARGS)]
    assert check.accepts(parser, form.two, parallel=True)
    if form.fmt != "openai":  # harmony: one call per turn (<|call|> ends it)
        assert [c.name for c in parser.parse(form.two).calls] == ["get_weather", "get_time"]
        assert not check.accepts(parser, form.two, parallel=False), "two calls where one was asked for"
    for bad in form.bad:
        assert not check.accepts(parser, bad, parallel=True), bad
    assert not check.accepts(parser, form.one, tools=[TIME]), "a tool that was not offered"


def test_special_markers_are_written_as_their_tokens(plain, special):
    parser = TOOL_PARSERS["openai"]()
    marks = special_markers(special, parser.markers)
    assert set(marks.special) == set(HARMONY_MARKERS)
    lark = parser.grammar([WEATHER], False, marks).lark
    assert f'<[{marks.tokens["<|channel|>"]}]>' in lark and '"<|channel|>"' not in lark
    assert "<|call|>" not in lark and f'<[{marks.tokens["<|call|>"]}]>' not in lark  # EOS: the grammar ends before it
    assert not special_markers(plain, parser.markers).tokens


@pytest.mark.parametrize("vocab", ["plain", "special"])
def test_dsml_token_inside_markers(vocab, request):
    """DeepSeek's ｜DSML｜ sits inside its markers: where it is a special token the grammar writes
    it as that token between quoted text, and a string value may hold "</" before its closer."""
    tok = request.getfixturevalue(vocab)
    parser = TOOL_PARSERS["deepseek_v32"]()
    marks = special_markers(tok, parser.markers)
    lark = parser.grammar([WEATHER], False, marks).lark
    assert ("｜DSML｜" in marks.special) == (vocab == "special")
    assert ("<[" in lark) == (vocab == "special") and (json.dumps("｜DSML｜") in lark) == (vocab == "plain")
    text = _dsml("function_calls", ("get_weather", {"city": "a</b> c", "days": 2}))
    assert checker(tok).accepts(parser, text)
    assert json.loads(parser.parse(text).calls[0].arguments) == {"city": "a</b> c", "days": 2}


def test_a_marker_that_is_an_added_token_but_not_special(plain):
    """Qwen's <tool_call>: one added token that decoding keeps. The grammar must name the token
    (llguidance never matches an added token against quoted text), the text needs no special tokens kept."""
    tok = copy.deepcopy(plain.hf)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    qwen = Tokenizer(tok, plain.eos_token_ids)
    check, parser = checker(qwen), TOOL_PARSERS["hermes"]()
    assert len(qwen.encode("<tool_call>", add_special_tokens=False)) == 1
    assert check.accepts(parser, FORMS[0].one) and check.accepts(parser, FORMS[0].two, parallel=True)

    class State:
        tokenizer = qwen

    assert special_markers(qwen, parser.markers).tokens and not keeps_specials(State, parser)


def test_mistral_v11_form_where_args_is_a_special_token(plain):
    tok = _with_specials(plain, ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"])
    check, parser = checker(tok), TOOL_PARSERS["mistral"]()
    one, two = f"[TOOL_CALLS]get_weather[ARGS]{A}", f"[TOOL_CALLS]get_weather[ARGS]{A}[TOOL_CALLS]get_time[ARGS]{T}"
    assert check.accepts(parser, one) and check.accepts(parser, two, parallel=True)
    assert not check.accepts(parser, two) and not check.accepts(parser, f"[TOOL_CALLS][{W_OBJ}]")
    assert [c.name for c in parser.parse(two).calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("opened", [True, False])
def test_reasoning_comes_before_a_forced_call(plain, opened):
    check = checker(plain)
    parser = ReasoningParser(TOOL_PARSERS["qwen3_coder"](), REASONING["qwen3"], opened)
    call = _qwen("get_weather", {"city": "Paris"})
    thought = ("" if opened else "<think>") + "Paris, so get_weather.\n</think>\n\n"
    assert check.accepts(parser, thought + call)
    assert check.accepts(parser, call) is not opened  # opened: the reasoning must end first
    assert not check.accepts(parser, thought + "Sure.")
    parsed = parser.parse(thought + call)
    assert parsed.reasoning == "Paris, so get_weather." and [c.name for c in parsed.calls] == ["get_weather"]


def test_a_format_without_a_grammar_says_so():
    with pytest.raises(NotImplementedError, match="none"):
        PlainParser().grammar(TOOLS, False)
    assert set(FORCED) == set(TOOL_PARSERS)


def test_special_markers_reach_the_parser_and_never_the_content(plain, special):
    """A harmony output decoded as the server decodes it for a format with special markers: kept
    for the parser, the end-of-output token hidden; the content shows none of them."""
    parser = TOOL_PARSERS["openai"]()

    class State:
        tokenizer = special

    assert keeps_specials(State, parser)
    assert parser_params(State, parser, SamplingParams()).skip_special_tokens is False
    State.tokenizer = plain
    assert not keeps_specials(State, parser) and not keeps_specials(State, None)
    assert parser_params(State, parser, SamplingParams()).skip_special_tokens is True
    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hello there.<|return|>"
    ids = special.encode(text, add_special_tokens=False)
    eos = special.eos_token_ids
    assert ids[-1] in eos
    kept, skipped = _decode(special, ids, keep=True), _decode(special, ids, keep=False)
    assert "<|return|>" not in kept and kept == text.removesuffix("<|return|>")
    assert "<|channel|>" not in skipped  # what the parser got before: the markers gone
    parsed = parser.parse(kept)
    assert parsed.content == "Hello there." and parsed.reasoning == "Think."
    assert parser.parse(skipped).reasoning is None


def _decode(tok: Tokenizer, ids: list[int], keep: bool) -> str:
    """The text the engine releases for ``ids`` (its TextState, as launch.py builds it), one token at a time."""
    state = text_state(tok, set(tok.eos_token_ids), SamplingParams(skip_special_tokens=not keep))
    return "".join(state.add(t, final=i == len(ids) - 1) for i, t in enumerate(ids))


@pytest.mark.parametrize("fmt", ["qwen3_coder", "glm45"])
def test_xml_parameters_take_only_enum_values(plain, fmt):
    tool = {"type": "function", "function": {"name": "go", "parameters": {
        "type": "object", "properties": {"to": {"type": "string", "enum": ["north", "south"]}}, "required": ["to"]}}}
    check, parser = checker(plain), TOOL_PARSERS[fmt]()
    write = _qwen if fmt == "qwen3_coder" else _glm
    assert check.accepts(parser, write("go", {"to": "north"}), tools=[tool])
    assert not check.accepts(parser, write("go", {"to": "west"}), tools=[tool])
    assert json.loads(parser.parse(write("go", {"to": "south"})).calls[0].arguments) == {"to": "south"}


def test_a_forced_call_in_a_format_without_a_grammar_is_a_400(plain):
    class State:
        tokenizer, tool_parser, reasoning = plain, PlainParser(), None

    with pytest.raises(APIError) as err:
        forced_grammar(State, [1, 2], TOOLS, False)
    assert err.value.status == 400 and err.value.param == "tool_choice" and "none" in err.value.message


@pytest.mark.parametrize("name", ['a"b', "<|im_end|>", "k>v", "two\nlines"])
@pytest.mark.parametrize("fmt", ["qwen3_coder", "glm45", "deepseek_v32", "deepseek_v4", "hermes"])
def test_a_parameter_name_an_xml_format_cannot_write_is_a_400_naming_tools(plain, fmt, name):
    """XML-like formats write parameter names bare (``<parameter=k>``, ``name="k"``): a name holding
    their delimiters would end or break the call, so a forced call with it is refused; JSON
    formats escape names and take it."""
    tool = {"type": "function", "function": {"name": "go", "parameters": {
        "type": "object", "properties": {name: {"type": "string"}}, "required": [name]}}}

    class State:
        tokenizer, tool_parser, reasoning = plain, TOOL_PARSERS[fmt](), None

    if fmt == "hermes":
        assert forced_grammar(State, [1, 2], [tool], False) is not None
        return
    with pytest.raises(APIError) as err:
        forced_grammar(State, [1, 2], [tool], False)
    assert err.value.status == 400 and err.value.param == "tools" and "cannot be written" in err.value.message


# Over HTTP: the embedded model served with --tool-call-parser qwen3_coder (XML parameters, not hermes).
READ = {"type": "function", "function": {"name": "read_file", "description": "Read a text file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "enum": ["notes.txt", "todo.txt"]}}, "required": ["path"]}}}
ASK = [{"role": "user", "content": "Read the file notes.txt"}]


@pytest.fixture(scope="module")
def qwen_server(launch_server):
    srv = launch_server("--max-model-len", "512", "--tool-call-parser", "qwen3_coder")
    yield srv
    srv.stop()


def _post(srv, path: str, body: dict) -> dict:
    r = httpx.post(srv.base_url + path, json={"model": srv.model, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_forced_call_over_http_in_the_servers_format(qwen_server):
    for choice in ("required", {"type": "function", "function": {"name": "read_file"}}):
        out = _post(qwen_server, "/v1/chat/completions", {
            "messages": ASK, "tools": [READ], "tool_choice": choice, "parallel_tool_calls": False,
            "temperature": 0, "max_tokens": 60})["choices"][0]
        assert out["finish_reason"] == "tool_calls", out
        (call,) = out["message"]["tool_calls"]
        assert call["function"]["name"] == "read_file"
        assert json.loads(call["function"]["arguments"])["path"] in ("notes.txt", "todo.txt")
        assert "<" not in (out["message"]["content"] or "")  # no marker of the format shows as text


def test_anthropic_tool_choice_any_over_http(qwen_server):
    out = _post(qwen_server, "/v1/messages", {
        "messages": ASK, "max_tokens": 60, "temperature": 0,
        "tools": [{"name": "read_file", "input_schema": READ["function"]["parameters"]}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    uses = [b for b in out["content"] if b["type"] == "tool_use"]
    assert out["stop_reason"] == "tool_use" and len(uses) == 1, out
    assert uses[0]["name"] == "read_file" and uses[0]["input"]["path"] in ("notes.txt", "todo.txt")


def test_streamed_and_responses_forced_calls_over_http(qwen_server):
    """Parallel calls allowed (the default): the stream sends the calls the non-streamed answer has."""
    body = {"messages": ASK, "tools": [READ], "tool_choice": "required", "temperature": 0, "max_tokens": 80}
    whole = [c["function"] for c in _post(qwen_server, "/v1/chat/completions", body)["choices"][0]["message"]["tool_calls"]]
    streamed: dict[int, dict] = {}
    with httpx.stream("POST", qwen_server.base_url + "/v1/chat/completions",
                      json={"model": qwen_server.model, "stream": True, **body}, timeout=120) as r:
        for line in r.iter_lines():
            chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
            for d in (chunk["choices"][0]["delta"].get("tool_calls") or []) if chunk.get("choices") else []:
                call = streamed.setdefault(d["index"], {"name": "", "arguments": ""})
                call["name"] += d["function"].get("name") or ""
                call["arguments"] += d["function"].get("arguments") or ""
    assert [streamed[i] for i in sorted(streamed)] == [{"name": c["name"], "arguments": c["arguments"]} for c in whole]
    out = _post(qwen_server, "/v1/responses", {
        "input": "Read the file notes.txt", "tool_choice": "required", "max_output_tokens": 60, "temperature": 0,
        "tools": [{"type": "function", "name": "read_file", "parameters": READ["function"]["parameters"]}]})
    (call,) = [o for o in out["output"] if o["type"] == "function_call"]
    assert call["name"] == "read_file" and json.loads(call["arguments"])["path"] in ("notes.txt", "todo.txt")


def test_string_parameters_stay_strings_over_http(qwen_server):
    """The request's schemas reach the parser: a string parameter whose text reads as JSON
    (the forced grammar writes one of the enum's texts) is a string on every route."""
    params = {"type": "object", "properties": {"path": {"type": "string", "enum": ["123", "null"]}}, "required": ["path"]}
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": params}}]
    body = {"messages": ASK, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 0, "max_tokens": 40}
    (call,) = _post(qwen_server, "/v1/chat/completions", body)["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["path"] in ("123", "null")
    arguments = ""
    with httpx.stream("POST", qwen_server.base_url + "/v1/chat/completions",
                      json={"model": qwen_server.model, "stream": True, **body}, timeout=120) as r:
        for line in r.iter_lines():
            chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
            for d in (chunk["choices"][0]["delta"].get("tool_calls") or []) if chunk.get("choices") else []:
                arguments += d["function"].get("arguments") or ""
    assert arguments == call["function"]["arguments"]
    out = _post(qwen_server, "/v1/messages", {
        "messages": ASK, "max_tokens": 40, "temperature": 0, "tools": [{"name": "read_file", "input_schema": params}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert [b["input"]["path"] for b in out["content"] if b["type"] == "tool_use"][0] in ("123", "null")
    out = _post(qwen_server, "/v1/responses", {
        "input": "Read the file notes.txt", "tool_choice": "required", "max_output_tokens": 40, "temperature": 0,
        "parallel_tool_calls": False, "tools": [{"type": "function", "name": "read_file", "parameters": params}]})
    (call,) = [o for o in out["output"] if o["type"] == "function_call"]
    assert json.loads(call["arguments"])["path"] in ("123", "null")


def test_command_r_vocabulary_from_llama_cpp():
    """llama.cpp's Command R vocabulary (models/ggml-vocab-command-r.gguf) holds <|END_OF_TURN_TOKEN|>
    (special, end of output) and <|CHATBOT_TOKEN|> (added) among the format's markers, not <|START_ACTION|>:
    the output keeps special tokens, the grammar names the added ones and quotes the rest."""
    tok = Tokenizer.from_path(llama_cpp_tree() / "models" / "ggml-vocab-command-r.gguf")
    parser = TOOL_PARSERS["command_r"]()
    marks = special_markers(tok, parser.markers)
    assert marks.special == {"<|END_OF_TURN_TOKEN|>"} and set(marks.tokens) == {"<|END_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>"}

    class State:
        tokenizer = tok

    assert keeps_specials(State, parser)
    check = checker(tok)
    form = next(f for f in FORMS if f.fmt == "command_r")
    assert check.accepts(parser, form.one) and not check.accepts(parser, form.two)
