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
chat template's text (:func:`quanta.server.tool_formats.registry.choose_parser`)
unless ``--tool-call-parser`` names one. The call and parsed-output types are
:mod:`quanta.server.tool_formats.calls`. What the template gets for a request with tools is
:mod:`quanta.server.tool_formats.templates`. The other families (DeepSeek, Kimi-K2,
Qwen3-Coder, GLM, gpt-oss harmony, ...) and reasoning are in
:mod:`quanta.server.tool_formats`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from quanta.server.tool_formats.calls import (
    HERMES_END,
    HERMES_START,
    Parsed,
    hermes_call,
    hermes_opens,
    in_order,
    joined_content,
    json_call,
    parse_json,
)
from quanta.server.tool_formats.scan import BlockScanner, partial_suffix
from quanta.server.tool_formats.stream import HermesStream, ToolStream, WholeCallStream

if TYPE_CHECKING:  # grammars load torch and transformers: imported when one is written (``quanta --help`` needs none)
    from quanta.engine.grammar import Grammar
    from quanta.server.tool_formats.lark import Lark, Marks


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
        return WholeCallStream(self)

    def call_start(self, text: str) -> int:
        """Index where a call begins in ``text`` (``len(text)`` if none); text before it is content."""
        i = text.find(self.start)
        return len(text) if i < 0 else i

    def safe_end(self, text: str) -> int:
        """How much of ``text`` (an unfinished output without a call yet) is content whatever
        follows: all but a tail that could still begin the call marker."""
        return len(text) - partial_suffix(text, self.start)



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

    name, start, end = "hermes", HERMES_START, HERMES_END
    markers = (start, end)

    def stream(self) -> ToolStream:
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
        return Parsed(joined_content(parts), calls, broken, in_order(pieces + [text[pos:]]))



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
            call = json_call(parse_json(piece.strip()), "parameters")
            if call is None:
                return Parsed(text or None, [])
            calls.append(call)
        return Parsed(joined_content([text[:i]]), calls, order=in_order([text[:i], *calls])) if calls else Parsed(text or None, [])


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
            found = [json_call(obj) for obj in items]
            if not found or None in found:
                return Parsed(text or None, [])
            for call, obj in zip(found, items, strict=True):
                if isinstance(obj.get("id"), str) and obj["id"]:
                    call.id = obj["id"]
            calls += found
        return Parsed(joined_content([text[:i]]), calls, order=in_order([text[:i], *calls])) if calls else Parsed(text or None, [])


