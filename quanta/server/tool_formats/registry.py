"""Which tool-call and reasoning format a model writes: by name, or detected from its chat template.

``--tool-call-parser`` and ``--reasoning-parser`` take vLLM's names where
vLLM has the format (:data:`TOOL_PARSERS`, :data:`REASONING`); otherwise
:func:`detect` reads the markers the chat template writes. :func:`output_parser`
builds what one request's output goes through: the tool format (or none when
the request has no tools) behind the reasoning splitter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quanta.server.tool_formats.base import HermesParser, Llama3JsonParser, MistralParser, ToolParser
from quanta.server.tool_formats.calls import Parsed
from quanta.server.tool_formats.families import FAMILIES
from quanta.server.tool_formats.harmony import HarmonyParser
from quanta.server.tool_formats.lark import Lark, Marks, special_markers
from quanta.server.tool_formats.reasoning import REASONING, ReasoningParser, ReasoningSyntax, prompt_opens
from quanta.server.tool_formats.stream import PlainStream, ToolStream

if TYPE_CHECKING:
    from quanta.engine.grammar import Grammar

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, HarmonyParser, *FAMILIES)}
#: vLLM's other names for the same formats
ALIASES = {"qwen3_xml": "qwen3_coder", "glm47": "glm45", "gpt_oss": "openai", "deepseek_r1": "deepseek_v3"}

#: (marker in the template, tool parser), first match wins
_TOOL_MARKERS = (
    ("<|channel|>", "openai"), ("｜DSML｜", "dsml"), ("tool▁sep", None), ("tool_calls_section_begin", "kimi_k2"),
    ("<arg_key>", "glm45"), ("<parameter=", "qwen3_coder"), ("[TOOL_CALLS]", "mistral"),
    ("<|START_ACTION|>", "command_r"), ("Action:", "command_r"), ("<|tool_call|>", "granite"),
    ("functools", "firefunction"), ("<function=", "functionary"), ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json"),
)
#: (marker in the template, reasoning parser), first match wins
_REASONING_MARKERS = (
    ("<seed:think>", "seed_oss"), ("[THINK]", "mistral"), ("<|START_THINKING|>", "command_r"), ("<think>", "deepseek_r1"),
)


def tool_parser_name(name: str) -> str:
    """``name`` as :data:`TOOL_PARSERS` spells it. Raises ValueError for an unknown name."""
    name = ALIASES.get(name, name)
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of: {', '.join(sorted(TOOL_PARSERS))}")
    return name


def reasoning_name(name: str) -> str:
    """``name`` as :data:`REASONING` spells it (``openai``/``gpt_oss``: harmony's own). Raises ValueError if unknown."""
    if name not in REASONING and name not in ("openai", "gpt_oss", "none"):
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: {', '.join(sorted(REASONING))}, openai, none")
    return name


def detect(template: str | None) -> tuple[str, str | None]:
    """(tool parser, reasoning parser or None) for a chat template's text (hermes when nothing matches)."""
    text = template or ""
    tool = next((name for marker, name in _TOOL_MARKERS if marker in text), "hermes")
    if tool is None:  # DeepSeek: V3/R1 write the arguments in a ```json fence, V3.1 does not
        tool = "deepseek_v3" if "```json" in text else "deepseek_v31"
    elif tool == "dsml":  # DeepSeek V3.2 names its block function_calls, V4 tool_calls
        tool = "deepseek_v32" if "function_calls" in text else "deepseek_v4"
    if tool == "openai":
        return tool, "openai"
    return tool, next((name for marker, name in _REASONING_MARKERS if marker in text), None)


def choose_parser(template: str | None, override: str | None = None) -> ToolParser:
    """The tool parser ``override`` names, else the template's (:func:`detect`). Raises ValueError for an unknown name."""
    name = tool_parser_name(override) if override else detect(template)[0]
    return TOOL_PARSERS[name]()


def choose_reasoning(template: str | None, override: str | None = None) -> ReasoningSyntax | None:
    """The reasoning syntax ``override`` names (``none``: no reasoning), else the template's; None for
    none (or harmony, whose parser reads reasoning itself). Raises ValueError for an unknown name."""
    name = reasoning_name(override) if override else detect(template)[1]
    return REASONING.get(name) if name else None


class PlainParser(ToolParser):
    """Content only (a request without tools)."""

    name, start = "none", ""

    def parse(self, text: str) -> Parsed:
        return Parsed(text or None, [])

    def stream(self) -> ToolStream:
        return PlainStream(self)


def output_parser(tools: ToolParser, reasoning: ReasoningSyntax | None, with_tools: bool,
                  opened: bool = False) -> ToolParser | None:
    """What one request's output is read with: ``tools`` (or content only when the request
    has none) behind ``reasoning`` (``opened``: the prompt left the model inside it); None when
    the output is plain text."""
    if getattr(tools, "reasons", False):
        return tools
    inner = tools if with_tools else PlainParser()
    if reasoning is None:
        return inner if with_tools else None
    return ReasoningParser(inner, reasoning, opened)


def request_parser(state, tools: list[dict] | bool | None, prompt: list[int]) -> ToolParser | None:
    """:func:`output_parser` for one request of a server ``state`` (its tool parser and reasoning
    syntax); ``tools``: the request's tools (OpenAI-shaped; their parameter schemas type the values
    of XML-like parameters) or whether it has any; the prompt's last tokens say whether the
    template opened the reasoning."""
    opened = False
    if state.reasoning is not None and prompt:
        tail = state.tokenizer.decode(prompt[-8:], skip_special_tokens=False)
        opened = prompt_opens(tail, state.reasoning)
    return output_parser(bound_parser(state.tool_parser, tools), state.reasoning, bool(tools), opened)


def bound_parser(parser: ToolParser, tools: list[dict] | bool | None) -> ToolParser:
    """``parser`` reading one request's output with its ``tools`` (see :meth:`.marked.MarkedParser.for_tools`)."""
    bind = getattr(parser, "for_tools", None)
    return bind(tools) if bind is not None and isinstance(tools, list) else parser


def request_marks(state, parser: ToolParser) -> Marks:
    """Which of ``parser``'s markers are tokens (and special tokens) of the served tokenizer."""
    return special_markers(state.tokenizer, tuple(parser.markers))


def keeps_specials(state, parser: ToolParser | None) -> bool:
    """Whether the text fed to ``parser`` must keep special tokens: some marker of its format
    is one (gpt-oss ``<|channel|>``, a tekken ``[TOOL_CALLS]``); decoding would drop it."""
    return parser is not None and bool(request_marks(state, parser).special)


def parser_params(state, parser: ToolParser | None, params):
    """``params`` decoding special tokens when ``parser``'s format needs them (:func:`keeps_specials`)."""
    if keeps_specials(state, parser):
        from dataclasses import replace

        return replace(params, skip_special_tokens=False)
    return params


def forced_grammar(state, prompt: list[int], tools: list[dict], parallel: bool, param: str = "tool_choice") -> Grammar:
    """The grammar that forces one call of ``tools`` (one or more if ``parallel``) in the served
    model's format, after any reasoning (:func:`request_parser` of ``prompt``).

    Raises:
        APIError: 400 naming ``param`` for a format that has no forced-call grammar, or naming
            ``tools`` for a parameter name an XML-like format cannot write (:class:`UnwritableName`).
    """
    from quanta.server.errors import APIError
    from quanta.server.tool_formats.forced import UnwritableName

    parser = request_parser(state, tools, prompt)
    try:
        return parser.grammar(tools, parallel, request_marks(state, parser))
    except NotImplementedError as exc:
        raise APIError(400, f"{param}: the {parser.name} tool-call format cannot force a call; "
                            "use tool_choice auto", param) from exc
    except UnwritableName as exc:
        raise APIError(400, f"tools: {exc} ({parser.name})", "tools") from exc


def schema_grammar(state, prompt: list[int], schema: dict) -> Grammar:
    """JSON of ``schema`` as the answer, after any reasoning the served model writes first
    (:meth:`ReasoningParser.after_reasoning`: the prompt's reasoning closed, or a whole block),
    so the JSON is the content and the reasoning stays reasoning."""
    from quanta.engine.grammar import Grammar

    parser = request_parser(state, False, prompt)
    if not isinstance(parser, ReasoningParser):
        return Grammar.json_schema(schema)
    lark = Lark(request_marks(state, parser))
    return lark.grammar(parser.after_reasoning(lark, lark.json(schema)))
