"""A tool call, an output split into text and calls, and reading a call from its JSON.

The pieces every format's parser (:mod:`quanta.server.tool_formats.base` and the
formats above it) and every stream (:mod:`quanta.server.tool_formats.stream`)
share: :class:`ToolCall`, :class:`Parsed`, JSON read as the stream reads it
(:func:`parse_json`: a repeated key keeps its first value), and one Hermes
``<tool_call>`` block's call (:func:`hermes_call`), which the Hermes parser and
its stream both read.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from quanta.server.tool_formats.scan import BlockScanner, ObjectScanner

#: What opens and closes a Hermes call block.
HERMES_START, HERMES_END = "<tool_call>", BlockScanner.END


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


def json_call(obj, args_key: str = "arguments") -> ToolCall | None:
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


def joined_content(parts: list[str]) -> str | None:
    """The text around calls, trailing whitespace dropped (what :mod:`~quanta.server.tool_formats.stream` streams)."""
    text = "".join(parts).rstrip()
    return text or None

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
    call = json_call(obj)
    head = HERMES_HEAD.match(stripped)
    if call is None or head is None or parse_json(head.group(1)) != call.name or stripped[head.end():][:1] != "{":
        return call
    end = ObjectScanner().feed(stripped[head.end():])
    raw = stripped[head.end():head.end() + end] if end is not None else None
    if raw is not None and parse_json(raw) == parse_json(call.arguments):
        call.arguments = raw
    return call
