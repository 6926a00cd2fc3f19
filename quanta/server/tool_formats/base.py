"""Tool calls in a model's native format: parsers and the grammars that force calls.

A :class:`ToolParser` knows one family's format:

- ``hermes`` (Hermes, Qwen 2/2.5/3, and quanta's fallback):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call;
- ``llama3_json`` (Llama 3.1-3.3 JSON tool calling):
  ``{"name": ..., "parameters": {...}}``, several separated by ``;``,
  optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (also
  the v11 form ``[TOOL_CALLS]name[ARGS]{...}``, with ``[CALL_ID]id`` before
  ``[ARGS]`` from Mistral Small 3.2 on).

Each parser splits a finished output into text and calls (:meth:`ToolParser.parse`;
a Hermes call's ``arguments`` are the object's text as the model wrote it,
which :mod:`quanta.server.tool_formats.stream` forwards while it streams), and
writes the grammar that forces calls for ``tool_choice`` ``required`` or a
named function (:meth:`ToolParser.grammar`). The parser is chosen from the
chat template's text (:func:`choose_parser`) unless ``--tool-call-parser``
names one. What the template gets for a request with tools is
:mod:`quanta.server.tool_formats.templates`. The other families (DeepSeek, Kimi-K2,
Qwen3-Coder, GLM, gpt-oss harmony, ...) and reasoning are in
:mod:`quanta.server.tool_formats`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quanta.server.tool_formats.scan import BlockScanner, ObjectScanner

if TYPE_CHECKING:  # grammars load torch and transformers: imported when one is written (``quanta --help`` needs none)
    from quanta.engine.grammar import Grammar
    from quanta.server.tool_formats.lark import Lark, Marks
    from quanta.server.tool_formats.stream import ToolStream


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class ToolCall:
    """One function call: ``arguments`` is a JSON object's text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def unused_id(call_id: str, earlier: list) -> str:
    """``call_id`` unless a call in ``earlier`` (the output's calls before it) has it, else a new id:
    formats whose ids the model writes (Kimi-K2, Command R) can repeat one, and a client matches
    each result to its call by id."""
    return new_call_id() if any(isinstance(c, ToolCall) and c.id == call_id for c in earlier) else call_id


@dataclass(slots=True)
class Parsed:
    """An output split into ``content`` (text around the calls, None if empty) and ``calls``.

    ``broken``: the output holds a block that began as a call (a Hermes
    ``<tool_call>{"name": ..., "arguments": {``) but did not end as one (cut
    by a stop string, ``max_tokens`` or EOS, or invalid JSON); its text is
    content, and the finish reason is the engine's, never ``tool_calls``
    (:attr:`made_calls`), as the stream reports it.
    """

    content: str | None
    calls: list[ToolCall]
    broken: bool = False
    #: the text pieces and calls in output order (:func:`in_order`); empty without calls
    order: list[str | ToolCall] = field(default_factory=list)
    #: the reasoning before the answer (:mod:`quanta.server.tool_formats.reasoning`), None if none
    reasoning: str | None = None

    def __post_init__(self) -> None:
        for i, call in enumerate(self.calls):  # each call's id unique in the output
            call.id = unused_id(call.id, self.calls[:i])

    @property
    def made_calls(self) -> bool:
        """Whether the output ended after complete calls only (``tool_calls`` / ``tool_use`` when it stopped)."""
        return bool(self.calls) and not self.broken


def _call(obj, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _first_wins(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose repeated keys keep their first value (as the stream reads ``name``)."""
    out: dict = {}
    for key, value in pairs:
        out.setdefault(key, value)
    return out


#: Decodes model output: a repeated key keeps its first value (``{"name": "a", "name": "b"}`` is ``a``).
_DECODER = json.JSONDecoder(object_pairs_hook=_first_wins)


def parse_json(text: str):
    """``text`` as JSON (the first of duplicate keys wins, as the stream reads it), or None if it is not JSON."""
    try:
        return _DECODER.decode(text)
    except ValueError:
        return None


def in_order(pieces: list[str | ToolCall]) -> list[str | ToolCall]:
    """Text pieces and calls in output order, as the stream sends them: a piece's trailing
    whitespace moves to the start of the next piece (dropped when none follows); empty pieces go."""
    out: list[str | ToolCall] = []
    space = ""
    for piece in pieces:
        if isinstance(piece, ToolCall):
            out.append(piece)
            continue
        text = space + piece
        body = text.rstrip()
        space = text[len(body):]
        if body:
            out.append(body)
    return out


def _content(parts: list[str]) -> str | None:
    """The text around calls, trailing whitespace dropped (what :mod:`~quanta.server.tool_formats.stream` streams)."""
    text = "".join(parts).rstrip()
    return text or None


class ToolParser:
    """One native tool-call format (see the module docstring)."""

    name: str
    #: text that opens the first call; everything before it is plain content
    start: str
    #: every marker the format writes (those that are special tokens must survive decoding)
    markers: tuple[str, ...] = ()

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def grammar(self, tools: list[dict], parallel: bool, marks: Marks | None = None) -> Grammar:
        """A grammar whose every match is one (or, if ``parallel``, one or more) call of ``tools``
        in this format (:mod:`quanta.server.tool_formats.forced`); ``marks``: which of its
        :attr:`markers` are special tokens of the vocabulary (none if None).

        Raises:
            NotImplementedError: the format has no forced-call grammar.
        """
        from quanta.server.tool_formats.lark import Lark, Marks

        lark = Lark(marks or Marks())
        return lark.grammar(self.forced_call(lark, tools, parallel))

    def forced_call(self, lark: Lark, tools: list[dict], parallel: bool) -> str:
        """The start expression of :meth:`grammar`, its rules added to ``lark``."""
        from quanta.server.tool_formats.forced import FORCED

        build = FORCED.get(self.name)
        if build is None:
            raise NotImplementedError(f"the {self.name} format has no forced-call grammar")
        return build(lark, tools, parallel)

    def stream(self) -> ToolStream:
        """A fresh :class:`quanta.server.tool_formats.stream.ToolStream` for one output in this format
        (content streamed up to the call marker, the calls sent whole at the end)."""
        from quanta.server.tool_formats.stream import WholeCallStream

        return WholeCallStream(self)

    def call_start(self, text: str) -> int:
        """Index where a call begins in ``text`` (``len(text)`` if none); text before it is content."""
        i = text.find(self.start)
        return len(text) if i < 0 else i

    def safe_end(self, text: str) -> int:
        """How much of ``text`` (an unfinished output without a call yet) is content whatever
        follows: all but a tail that could still begin the call marker."""
        return len(text) - partial_suffix(text, self.start)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

    A block ends at the first ``</tool_call>`` outside the JSON strings of
    its leading object (:class:`quanta.server.tool_formats.scan.BlockScanner`: inside a string the marker is
    data), else at the end of the output. It is a call when it begins with
    one JSON object with a string ``name`` and object (or JSON-string)
    ``arguments``; a repeated key keeps its first value. Text after that
    object, before ``</tool_call>``, is dropped (not content, not part of
    the call), here and in the stream. Other blocks stay text. When the
    object starts ``{"name": ..., "arguments": {`` the call's ``arguments``
    are the text of that object exactly as the model wrote it (so the
    stream can forward it as it comes, :mod:`quanta.server.tool_formats.stream`);
    otherwise they are the object re-serialized with :func:`json.dumps`.
    """

    name, start, end = "hermes", "<tool_call>", BlockScanner.END
    markers = (start, end)

    def stream(self) -> ToolStream:
        from quanta.server.tool_formats.stream import HermesStream

        return HermesStream(self)

    def parse(self, text: str) -> Parsed:
        calls, parts, pieces, pos, broken = [], [], [], 0, False
        i = text.find(self.start)
        while i >= 0:
            body = i + len(self.start)
            end = BlockScanner().feed(text[body:])
            stop = len(text) if end is None else body + end
            block = text[body:stop if end is None else stop - len(self.end)]
            call = hermes_call(block)
            if call is not None:
                parts.append(text[pos:i])
                pieces += [text[pos:i], call]
                calls.append(call)
                pos = stop
            broken = broken or (call is None and hermes_opens(block))
            i = text.find(self.start, stop)
        parts.append(text[pos:])
        if not calls:
            return Parsed(text or None, [], broken)
        return Parsed(_content(parts), calls, broken, in_order(pieces + [text[pos:]]))


#: The start of a Hermes call object up to its arguments value: group 1 is the name's JSON string.
HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def hermes_opens(block: str) -> bool:
    """Whether a block's text starts as a streamable call (:data:`HERMES_HEAD`, then ``{``):
    the point from which the stream has sent the call's name."""
    head = HERMES_HEAD.match(block)
    return head is not None and block[head.end():][:1] == "{"


def hermes_call(block: str) -> ToolCall | None:
    """The call in the text between ``<tool_call>`` and ``</tool_call>``, or None.

    ``arguments`` is the raw text of the arguments object when the block
    starts as :data:`HERMES_HEAD` says and that text decodes to the same
    value as the whole block's ``arguments``; else ``json.dumps`` of it.
    """
    stripped = block.lstrip()
    try:
        obj, _ = _DECODER.raw_decode(stripped)
    except ValueError:
        return None
    call = _call(obj)
    head = HERMES_HEAD.match(stripped)
    if call is None or head is None or parse_json(head.group(1)) != call.name or stripped[head.end():][:1] != "{":
        return call
    end = ObjectScanner().feed(stripped[head.end():])
    raw = stripped[head.end():head.end() + end] if end is not None else None
    if raw is not None and parse_json(raw) == parse_json(call.arguments):
        call.arguments = raw
    return call


class Llama3JsonParser(ToolParser):
    name, start = "llama3_json", "<|python_tag|>"
    markers = (start,)

    def call_start(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith("{") or stripped.startswith(self.start):
            return len(text) - len(stripped)
        return super().call_start(text)

    def parse(self, text: str) -> Parsed:
        i = self.call_start(text)
        body = text[i:].removeprefix(self.start).strip()
        calls = []
        for piece in body.split(";") if body else []:
            call = _call(parse_json(piece.strip()), "parameters")
            if call is None:
                return Parsed(text or None, [])
            calls.append(call)
        return Parsed(_content([text[:i]]), calls, order=in_order([text[:i], *calls])) if calls else Parsed(text or None, [])


class MistralParser(ToolParser):
    name, start = "mistral", "[TOOL_CALLS]"
    markers = (start, "[ARGS]", "[CALL_ID]")
    _v11 = re.compile(r"\s*([A-Za-z0-9_.-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\](.*)", re.S)

    def call_start(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith('[{"name"'):  # [TOOL_CALLS] is a special token: decoding drops it
            return len(text) - len(stripped)
        return super().call_start(text)

    def safe_end(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped and '[{"name"'.startswith(stripped):  # may still become the bare array
            return len(text) - len(stripped)
        return super().safe_end(text)

    def parse(self, text: str) -> Parsed:
        i = self.call_start(text)
        if i == len(text):
            return Parsed(text or None, [])
        calls = []
        for segment in text[i:].split(self.start):
            if not segment.strip():
                continue
            parsed = parse_json(segment.strip())
            if parsed is None and (m := self._v11.match(segment)):
                parsed = {"name": m.group(1), "arguments": parse_json(m.group(3).strip()), "id": m.group(2)}
            items = parsed if isinstance(parsed, list) else [parsed]
            found = [_call(obj) for obj in items]
            if not found or None in found:
                return Parsed(text or None, [])
            for call, obj in zip(found, items, strict=True):
                if isinstance(obj.get("id"), str) and obj["id"]:
                    call.id = obj["id"]
            calls += found
        return Parsed(_content([text[:i]]), calls, order=in_order([text[:i], *calls])) if calls else Parsed(text or None, [])


def choose_parser(template: str | None, override: str | None = None) -> ToolParser:
    """The parser ``override`` names (vLLM's names), else the one whose markers the chat
    template writes (:func:`quanta.server.tool_formats.registry.detect`), else hermes (the
    fallback prompt's format).

    Raises:
        ValueError: an unknown ``override``.
    """
    from quanta.server.tool_formats.registry import choose_parser as choose

    return choose(template, override)
