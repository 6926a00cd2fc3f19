"""Streaming tool calls: content and call deltas while the model writes them.

:func:`tool_stream` gives a :class:`ToolStream` for a parser. Feed it each
text delta of the output (:meth:`ToolStream.feed`), then call
:meth:`ToolStream.finish` once; both return :data:`Event` lists in output
order:

- :class:`TextDelta`: content (text around the calls);
- :class:`CallOpened`: a call's index (0, 1, ... in the output), id and name,
  sent once the name is known;
- :class:`ArgumentsDelta`: a fragment of that call's ``arguments``;
- :class:`CallClosed`: the call is complete (the :class:`ToolCall` in full).

The rule that makes streamed and non-streamed answers agree: for every
output whose calls are valid JSON (always, under ``tool_choice``'s grammar),
the concatenated ``TextDelta`` texts equal ``parser.parse(output).content``
(``""`` for None), the calls equal ``parse``'s calls (name and ``arguments``
string), and each call's ``ArgumentsDelta`` fragments concatenate to its
``arguments``. Trailing whitespace of the content is held back (sent only
when more content follows; dropped at the end if the output made calls, as
``parse`` drops it).

Hermes (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``)
streams incrementally: once ``{"name": "...", "arguments":`` is read and the
value starts with ``{``, the raw text of the arguments object is forwarded
as it arrives (a tail that may begin ``</tool_call>`` is held back), ending
at its matching ``}``; the wrapper's closing brace is never sent. A block
ends where :class:`quanta.server.tool_formats.scan.BlockScanner` says, for both the
stream and the parser: a ``</tool_call>`` inside a JSON string of the call
is data; a repeated key keeps its first value (``name`` included); text
after the call object, before ``</tool_call>``, is dropped in both.
:class:`quanta.server.tool_formats.base.HermesParser` reports that same raw text as the
call's arguments (both read a block with
:func:`quanta.server.tool_formats.calls.hermes_call`). Blocks of another shape
(``arguments`` first, or a JSON string) are sent whole when their ``</tool_call>`` arrives, as are invalid
ones (as content). What cannot be taken back: once a call's name is sent,
an output that then ends inside the call (a stop string, ``max_tokens``,
EOS) or whose JSON breaks has streamed a call with incomplete
``arguments``, ended by a ``CallClosed`` with ``complete=False``, while the
non-streamed answer keeps such text as content. Both then agree on the
finish reason: such a call sets :attr:`ToolStream.broken` (and
:attr:`quanta.server.tool_formats.calls.Parsed.broken`), so ``made_calls`` is False and
the finish reason is the engine's (``stop`` / ``length``), never
``tool_calls`` (``tool_use``).

Llama 3 JSON and Mistral ``[TOOL_CALLS]`` do not stream their calls: they
are all-or-nothing formats (one invalid call makes the whole output text),
so from the call marker on the output is held and, at the end, each call is
sent as ``CallOpened``, one ``ArgumentsDelta`` with all its arguments, and
``CallClosed``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from quanta.server.tool_formats.calls import HERMES_END, HERMES_HEAD, HERMES_START, Parsed, ToolCall, hermes_call, unused_id
from quanta.server.tool_formats.scan import BlockScanner, ObjectScanner, partial_suffix


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Reasoning text (``<think>`` and its kin, harmony's analysis channel): :mod:`quanta.server.tool_formats.reasoning`."""

    text: str


@dataclass(frozen=True, slots=True)
class CallOpened:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class CallClosed:
    index: int
    call: ToolCall
    #: False when the call did not end as one (cut inside it, or invalid JSON; see the module docstring)
    complete: bool = True


Event = TextDelta | ReasoningDelta | CallOpened | ArgumentsDelta | CallClosed


class CallFormat(Protocol):
    """What a stream reads its output with: a tool-call format
    (:class:`quanta.server.tool_formats.base.ToolParser` and the formats built on it)."""

    name: str

    def parse(self, text: str) -> Parsed: ...

    def call_start(self, text: str) -> int: ...

    def safe_end(self, text: str) -> int: ...

    def stream(self) -> ToolStream: ...


def tool_stream(parser: CallFormat) -> ToolStream:
    """A fresh stream for one output in ``parser``'s format (its ``stream()``)."""
    return parser.stream()


class ToolStream:
    """Turns one output's text deltas into :data:`Event` lists (see the module docstring)."""

    def __init__(self, parser: CallFormat) -> None:
        self.parser = parser  # the format; its parse() gives the non-streamed answer
        self.calls: list[ToolCall] = []  # the calls closed so far (complete or not)
        self.broken = False  # a call that did not end as one was sent (see the module docstring)
        self._events: list[Event] = []
        self._space = ""  # trailing whitespace of the content, held back

    @property
    def made_calls(self) -> bool:
        """Whether the output ended after complete calls only: then a stop is ``tool_calls``
        (``tool_use``); otherwise the finish reason is the engine's (``stop``, ``length``)."""
        return bool(self.calls) and not self.broken

    def feed(self, delta: str) -> list[Event]:
        """Consume ``delta``; the events it completes (adjacent text or same-call fragments merged)."""
        self._feed(delta)
        return self._take()

    def finish(self) -> list[Event]:
        """The remaining events once the output is complete; call once, after the last :meth:`feed`."""
        self._finish()
        if self._space and not self.calls:
            self._events.append(TextDelta(self._space))
        self._space = ""
        return self._take()

    def _feed(self, delta: str) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def _text(self, text: str) -> None:
        body = text.rstrip()
        if body:
            self._events.append(TextDelta(self._space + body))
            self._space = ""
        self._space += text[len(body):]

    def _whole_call(self, call: ToolCall) -> None:
        index = len(self.calls)
        call.id = unused_id(call.id, self.calls)
        self._events += [CallOpened(index, call.id, call.name), ArgumentsDelta(index, call.arguments)]
        self._close(call)

    def _close(self, call: ToolCall, complete: bool = True) -> None:
        self._events.append(CallClosed(len(self.calls), call, complete))
        self.calls.append(call)
        self.broken = self.broken or not complete

    def _take(self) -> list[Event]:
        out: list[Event] = []
        for e in self._events:
            last = out[-1] if out else None
            if isinstance(e, TextDelta | ReasoningDelta) and type(last) is type(e):
                out[-1] = type(e)(last.text + e.text)
            elif isinstance(e, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == e.index:
                out[-1] = ArgumentsDelta(e.index, last.text + e.text)
            elif not (isinstance(e, ArgumentsDelta) and not e.text):
                out.append(e)
        self._events = []
        return out


class HermesStream(ToolStream):
    """Hermes blocks, arguments forwarded as written (see the module docstring).

    States: ``text`` (content, looking for ``<tool_call>``), and inside a
    block (whose end a :class:`BlockScanner` finds, as the parser does):
    ``head`` (until the name and the start of the arguments are read),
    ``whole`` (a block that cannot stream: held to its end), ``args`` (the
    arguments object, forwarded), ``tail`` (after the arguments, up to
    ``</tool_call>``).
    """

    START, END = HERMES_START, HERMES_END

    def __init__(self, parser: CallFormat) -> None:
        super().__init__(parser)
        self._mode = "text"
        self._buf = ""  # text after the current block (or all of it, in text mode) not yet consumed
        self._block = ""  # the current block's text so far, after <tool_call>
        self._blocks = BlockScanner()
        self._sent = 0  # how much of _block was forwarded as arguments
        self._call: ToolCall | None = None
        self._scanner = ObjectScanner()

    def _feed(self, delta: str) -> None:
        self._buf += delta
        while self._step():
            pass

    def _step(self) -> bool:
        if self._mode == "text":
            return self._in_text()
        piece, self._buf = self._buf, ""
        end = self._blocks.feed(piece)
        if end is None:
            self._block += piece
            self._advance(self._blocks.held)
            return False
        self._buf = piece[end:]
        self._block = (self._block + piece[:end])[:-len(self.END)]
        self._advance(0)
        self._end_block(closed=True)
        return True

    def _in_text(self) -> bool:
        i = self._buf.find(self.START)
        if i >= 0:
            self._text(self._buf[:i])
            self._buf, self._mode = self._buf[i + len(self.START):], "head"
            self._block, self._blocks, self._sent = "", BlockScanner(), 0
            return True
        keep = len(self._buf) - partial_suffix(self._buf, self.START)
        self._text(self._buf[:keep])
        self._buf = self._buf[keep:]
        return False

    def _advance(self, held: int) -> None:
        """Act on the block text so far, all but its last ``held`` characters (a possible marker start)."""
        if self._mode == "head":
            head = HERMES_HEAD.match(self._block)
            if head is None or head.end() >= len(self._block) - held:
                return
            if self._block[head.end()] != "{":
                self._mode = "whole"
                return
            self._call = ToolCall(json.loads(head.group(1)), "")
            self._events.append(CallOpened(len(self.calls), self._call.id, self._call.name))
            self._mode, self._sent, self._scanner = "args", head.end(), ObjectScanner()
        if self._mode == "args":
            region = self._block[self._sent:len(self._block) - held]
            done = self._scanner.feed(region)
            taken = region if done is None else region[:done]
            self._arguments(taken)
            self._sent += len(taken)
            if done is not None:
                self._mode = "tail"

    def _end_block(self, closed: bool) -> None:
        if self._mode in ("head", "whole"):
            call = hermes_call(self._block)
            if call is not None:
                self._whole_call(call)
            else:
                self._text(self.START + self._block + (self.END if closed else ""))
        else:
            if self._mode == "args":  # ended inside the arguments: forward what is left
                self._arguments(self._block[self._sent:])
            call, self._call = self._call, None
            self._close(call, complete=hermes_call(self._block) is not None)
        self._mode = "text"

    def _finish(self) -> None:
        if self._mode == "text":
            self._text(self._buf)
        else:
            self._advance(0)
            self._end_block(closed=False)
        self._buf = ""

    def _arguments(self, text: str) -> None:
        self._call.arguments += text
        self._events.append(ArgumentsDelta(len(self.calls), text))


class WholeCallStream(ToolStream):
    """Content streamed up to the call marker; the calls sent whole at the end
    (the fallback for formats that do not stream, see the module docstring)."""

    def __init__(self, parser: CallFormat) -> None:
        super().__init__(parser)
        self.text = ""
        self._released = 0
        self._in_call = False

    def _feed(self, delta: str) -> None:
        self.text += delta
        if self._in_call:
            return
        start = self.parser.call_start(self.text)
        self._in_call = start < len(self.text)
        end = start if self._in_call else self.parser.safe_end(self.text)
        if end > self._released:
            self._text(self.text[self._released:end])
            self._released = end

    def _finish(self) -> None:
        parsed = self.parser.parse(self.text)
        if not parsed.calls:
            self._text(self.text[self._released:])
        for call in parsed.calls:
            self._whole_call(call)


class PlainStream(ToolStream):
    """Content only (a request without tools behind a reasoning splitter)."""

    def _feed(self, delta: str) -> None:
        self._text(delta)

    def _finish(self) -> None:
        pass
