"""Tool calls written between marker strings, read by one state machine.

A :class:`Syntax` describes a family: the markers that begin a call, what
ends its name, how its arguments are written (a JSON object, a JSON array of
whole calls, or XML-like parameters) and which markers close it. One
:class:`Machine` reads output text fed in pieces of any size and reports to a
sink: content text, a call opened (name known), argument fragments, a call
closed (complete or not), a whole call. :class:`MarkedParser` runs it over a
finished output (``parse``); :class:`MarkedStream` maps its reports onto the
stream events of :mod:`quanta.server.tool_formats.stream`. Both use the same
machine, which decides nothing until the text read so far determines it (a
tail that may begin a marker is held), so a stream fed one character at a
time reports what ``parse`` reports.

A call whose name never ends or whose arguments do not start as the syntax
says was not a call: its text is content. A call that was opened and then
did not end as one (output cut inside it, invalid JSON) is ``broken``: the
stream has sent it (closed incomplete), ``parse`` keeps its text as content.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from quanta.server.tool_formats.base import ToolParser
from quanta.server.tool_formats.calls import Parsed, ToolCall, in_order, joined_content, parse_json, unused_id
from quanta.server.tool_formats.params import ParamReader, ParamSyntax, param_schemas
from quanta.server.tool_formats.scan import ObjectScanner, partial_suffix
from quanta.server.tool_formats.stream import ArgumentsDelta, CallOpened, ReasoningDelta, ToolStream


def plain_name(raw: str) -> tuple[str, str | None]:
    """A name written as is: (name, no id)."""
    return raw.strip(), None


@dataclass(frozen=True)
class Syntax:
    """One family's call markers (see the module docstring)."""

    #: markers that begin a call; text before one is content
    begins: tuple[str, ...]
    #: markers that end the name (the first found wins)
    name_ends: tuple[str, ...] = ()
    #: markers dropped where they appear in content (a section's opening marker)
    drops: tuple[str, ...] = ()
    #: markers dropped after a call's arguments (call and section ends, code fences)
    closers: tuple[str, ...] = ()
    #: the text between a begin marker and its name end -> (name, the model's call id or None)
    name_of: Callable[[str], tuple[str, str | None]] = plain_name
    #: XML-like parameters instead of a JSON arguments object
    params: ParamSyntax | None = None
    #: a begin marker may be followed by a JSON array of whole calls (``[{"name": ..., "arguments": ...}]``)
    arrays: bool = False
    #: a begin marker is followed by a name (False: only the array form)
    named: bool = True


def array_calls(items) -> list[ToolCall] | None:
    """The calls of a JSON array of ``{"name"|"tool_name", "arguments"|"parameters", "id"|"tool_call_id"}``, or None."""
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for obj in items:
        if not isinstance(obj, dict):
            return None
        name = obj.get("name", obj.get("tool_name"))
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = parse_json(args)
        if not isinstance(name, str) or not isinstance(args, dict):
            return None
        call = ToolCall(name, json.dumps(args, ensure_ascii=False))
        given = obj.get("id", obj.get("tool_call_id"))
        if isinstance(given, str | int) and str(given):
            call.id = str(given)
        calls.append(call)
    return calls


def first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(index, marker) of the earliest marker in ``text`` (the longest at a tie), or (-1, "")."""
    best, found = -1, ""
    for m in markers:
        i = text.find(m)
        if i >= 0 and (best < 0 or i < best or (i == best and len(m) > len(found))):
            best, found = i, m
    return best, found


def held_tail(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` may begin one of ``markers``."""
    return max((partial_suffix(text, m) for m in markers), default=0)


def _valid_name(name: str) -> bool:
    return 0 < len(name) <= 256 and not any(ch.isspace() for ch in name)


class Sink:
    """What the machine reports to (see the module docstring)."""

    def text(self, text: str) -> None: ...
    def reasoning(self, text: str) -> None: ...
    def open(self, name: str, call_id: str | None) -> None: ...
    def args(self, text: str) -> None: ...
    def close(self, complete: bool, raw: str) -> None: ...
    def whole(self, call: ToolCall) -> None: ...


class ModeMachine:
    """A reader in modes: ``mode`` names the method ``_MODE(final)`` that consumes what it can of
    ``buf`` and returns whether it made progress; each step runs them until none does."""

    mode: str
    buf: str

    def feed(self, text: str) -> None:
        self.buf += text
        self._run(False)

    def _run(self, final: bool) -> None:
        while getattr(self, "_" + self.mode)(final):
            pass


@dataclass
class Machine(ModeMachine):
    """Reads one output's text in pieces; reports to ``sink`` (see the module docstring)."""

    syntax: Syntax
    sink: Sink
    mode: str = "text"  # text, body, name, lead, json, array, params, after
    buf: str = ""  # text fed and not yet consumed
    raw: str = ""  # the current call's text so far, from its begin marker
    name: str = ""
    call_id: str | None = None
    scanner: ObjectScanner = field(default_factory=ObjectScanner)
    reader: ParamReader | None = None
    args_text: str = ""  # the current JSON arguments (or array of calls) so far
    #: tool name -> parameter name -> its schema (:func:`.params.param_schemas`), for XML-like parameters
    schemas: dict[str, dict[str, dict]] = field(default_factory=dict)

    def finish(self) -> None:
        self._run(True)
        if self.mode in ("json", "params"):
            self.sink.close(False, self.raw + self.buf)
        elif self.mode != "text":
            self.sink.text(self.raw + self.buf)
        elif self.buf:
            self.sink.text(self.buf)
        self.buf, self.mode = "", "text"

    def _take(self, n: int) -> str:
        piece, self.buf = self.buf[:n], self.buf[n:]
        self.raw += piece
        return piece

    def _revert(self) -> bool:
        """Not a call after all: the begin marker is content and the text after it is read again."""
        marker, rest = self.raw, ""
        for begin in self.syntax.begins:
            if self.raw.startswith(begin):
                marker, rest = begin, self.raw[len(begin):]
                break
        self.sink.text(marker)
        self.buf, self.raw, self.mode = rest + self.buf, "", "text"
        return True

    def _text(self, final: bool) -> bool:
        markers = self.syntax.begins + self.syntax.drops
        i, marker = first_marker(self.buf, markers)
        if i < 0:
            keep = len(self.buf) if final else len(self.buf) - held_tail(self.buf, markers)
            if keep:
                self.sink.text(self.buf[:keep])
                self.buf = self.buf[keep:]
            return False
        if i:
            self.sink.text(self.buf[:i])
        self.buf = self.buf[i + len(marker):]
        if marker in self.syntax.begins:
            self.raw, self.mode = marker, "body" if self.syntax.arrays else "name"
        return True

    def _body(self, final: bool) -> bool:
        lead = self.buf.lstrip()
        if not lead and not final:
            return False
        if lead.startswith("["):
            self._take(len(self.buf) - len(lead))
            self.mode, self.scanner, self.args_text = "array", ObjectScanner(), ""
        elif self.syntax.named:
            self.mode = "name"
        else:
            return self._revert()
        return True

    def _name(self, final: bool) -> bool:
        i, marker = first_marker(self.buf, self.syntax.name_ends)
        if i < 0:
            return self._revert() if final or len(self.buf) > 512 else False
        name, call_id = self.syntax.name_of(self.buf[:i])
        if not _valid_name(name):
            return self._revert()
        keep = self.syntax.params is not None and marker in self.syntax.params.starts
        self._take(i if keep else i + len(marker))
        self.name, self.call_id = name, call_id
        if self.syntax.params is not None:
            self.sink.open(name, call_id)
            self.mode, self.reader = "params", ParamReader(self.syntax.params, self.schemas.get(name, {}))
        else:
            self.mode = "lead"
        return True

    def _lead(self, final: bool) -> bool:
        lead = self.buf.lstrip()
        if not lead:
            return self._revert() if final else False
        if lead[0] != "{":
            return self._revert()
        self._take(len(self.buf) - len(lead))
        self.sink.open(self.name, self.call_id)
        self.mode, self.scanner, self.args_text = "json", ObjectScanner(), ""
        return True

    def _json(self, final: bool) -> bool:
        end = self.scanner.feed(self.buf)
        piece = self._take(len(self.buf) if end is None else end)
        self.args_text += piece
        self.sink.args(piece)
        if end is None:
            return False
        self.sink.close(isinstance(parse_json(self.args_text), dict), self.raw)
        self.raw, self.mode = "", "after"
        return True

    def _array(self, final: bool) -> bool:
        end = self.scanner.feed(self.buf)
        self.args_text += self._take(len(self.buf) if end is None else end)
        if end is None:
            return self._revert() if final else False
        calls = array_calls(parse_json(self.args_text))
        if calls is None:
            return self._revert()
        for call in calls:
            self.sink.whole(call)
        self.raw, self.mode = "", "after"
        return True

    def _params(self, final: bool) -> bool:
        done = self.reader.feed(self.buf, final)
        self._take(self.reader.consumed)
        for piece in self.reader.take():
            self.sink.args(piece)
        if done is None:
            return False
        self.sink.close(done, self.raw)
        self.raw, self.mode = "", "after"
        return True

    def _after(self, final: bool) -> bool:
        lead = self.buf.lstrip()
        for closer in self.syntax.closers:
            if lead.startswith(closer):
                self.buf = lead[len(closer):]
                return True
        if not final and (not lead or any(c.startswith(lead) for c in self.syntax.closers)):
            return False
        self.mode = "text"
        return True


class Pieces(Sink):
    """Collects a finished output's text and calls in order (for :meth:`MarkedParser.parse`)."""

    def __init__(self) -> None:
        self.pieces: list[str | ToolCall] = []
        self.call: ToolCall | None = None
        self.broken = False
        self.thought: list[str] = []

    def text(self, text: str) -> None:
        self.pieces.append(text)

    def reasoning(self, text: str) -> None:
        self.thought.append(text)

    def open(self, name: str, call_id: str | None) -> None:
        self.call = ToolCall(name, "")
        if call_id:
            self.call.id = call_id

    def args(self, text: str) -> None:
        self.call.arguments += text

    def close(self, complete: bool, raw: str) -> None:
        self.pieces.append(self.call if complete else raw)
        self.broken = self.broken or not complete
        self.call = None

    def whole(self, call: ToolCall) -> None:
        self.pieces.append(call)


def parsed_of(pieces: list[str | ToolCall], broken: bool, reasoning: str | None = None) -> Parsed:
    """A :class:`Parsed` of text pieces and calls in output order."""
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    texts = [p for p in pieces if isinstance(p, str)]
    if not calls:
        return Parsed("".join(texts) or None, [], broken, reasoning=reasoning)
    return Parsed(joined_content(texts), calls, broken, in_order(pieces), reasoning)


def run_sink(machine, sink: Pieces, text: str) -> Parsed:
    """Feed a finished output to ``machine`` (reporting to ``sink``) and read what it found."""
    machine.feed(text)
    machine.finish()
    return parsed_of(sink.pieces, sink.broken, "".join(sink.thought) or None)


class MarkedParser(ToolParser):
    """A format read by :class:`Machine` over its :class:`Syntax`."""

    syntax: Syntax
    #: markers the format writes that its syntax reads inside a name (DeepSeek V3's ``<｜tool▁sep｜>``)
    inner_markers: tuple[str, ...] = ()
    #: the request's parameter schemas per tool (:meth:`for_tools`; XML-like parameters are typed by them)
    schemas: dict[str, dict[str, dict]] = {}

    def for_tools(self, tools: list[dict] | None) -> MarkedParser:
        """This parser reading one request's output: its ``tools`` (OpenAI-shaped) type the
        values of XML-like parameters (:mod:`.params`). Formats with JSON arguments need none."""
        if self.syntax.params is None or not tools:
            return self
        bound = copy.copy(self)
        bound.schemas = param_schemas(tools)
        return bound

    @property
    def start(self) -> str:
        return self.syntax.begins[0]

    @property
    def markers(self) -> tuple[str, ...]:
        s = self.syntax
        params = (s.params.key_open, s.params.key_close, s.params.value_open, s.params.value_close, s.params.end) \
            if s.params else ()
        every = (*s.begins, *s.drops, *s.closers, *s.name_ends, *params, *self.inner_markers)
        return tuple(m for m in every if m.strip())

    def parse(self, text: str) -> Parsed:
        sink = Pieces()
        return run_sink(Machine(self.syntax, sink, schemas=self.schemas), sink, text)

    def stream(self) -> ToolStream:
        return MarkedStream(self)


class MarkedStream(ToolStream, Sink):
    """The stream of a :class:`MarkedParser`'s format."""

    def __init__(self, parser: ToolParser, machine=None) -> None:
        super().__init__(parser)
        self._machine = machine(self) if machine else Machine(parser.syntax, self, schemas=parser.schemas)
        self._call: ToolCall | None = None

    def _feed(self, delta: str) -> None:
        self._machine.feed(delta)

    def _finish(self) -> None:
        self._machine.finish()

    def text(self, text: str) -> None:
        self._text(text)

    def reasoning(self, text: str) -> None:
        self._events.append(ReasoningDelta(text))

    def open(self, name: str, call_id: str | None) -> None:
        self._call = ToolCall(name, "")
        if call_id:
            self._call.id = unused_id(call_id, self.calls)
        self._events.append(CallOpened(len(self.calls), self._call.id, name))

    def args(self, text: str) -> None:
        self._call.arguments += text
        self._events.append(ArgumentsDelta(len(self.calls), text))

    def close(self, complete: bool, raw: str) -> None:
        call, self._call = self._call, None
        self._close(call, complete)

    def whole(self, call: ToolCall) -> None:
        self._whole_call(call)
