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
at its matching ``}``; the wrapper's closing brace is never sent.
:class:`quanta.server.tools.HermesParser` reports that same raw text as the
call's arguments. Blocks of another shape (``arguments`` first, or a JSON
string) are sent whole when their ``</tool_call>`` arrives, as are invalid
ones (as content). What cannot be taken back: once a call's name is sent,
an output that then stops inside the arguments (``max_tokens``) or whose
JSON breaks has streamed a call with incomplete ``arguments`` (ended by its
``CallClosed``), while the non-streamed answer keeps such text as content.

Llama 3 JSON and Mistral ``[TOOL_CALLS]`` do not stream their calls: they
are all-or-nothing formats (one invalid call makes the whole output text),
so from the call marker on the output is held and, at the end, each call is
sent as ``CallOpened``, one ``ArgumentsDelta`` with all its arguments, and
``CallClosed``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from quanta.server.tools import HERMES_HEAD, HermesParser, ObjectScanner, ToolCall, ToolParser, hermes_call, partial_suffix


@dataclass(frozen=True, slots=True)
class TextDelta:
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


Event = TextDelta | CallOpened | ArgumentsDelta | CallClosed


def tool_stream(parser: ToolParser) -> ToolStream:
    """A fresh stream for one output in ``parser``'s format (incremental for Hermes)."""
    return HermesStream(parser) if isinstance(parser, HermesParser) else WholeCallStream(parser)


class ToolStream:
    """Turns one output's text deltas into :data:`Event` lists (see the module docstring)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser  # the format; its parse() gives the non-streamed answer
        self.calls: list[ToolCall] = []  # the calls closed so far
        self._events: list[Event] = []
        self._space = ""  # trailing whitespace of the content, held back

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
        self._events += [CallOpened(index, call.id, call.name), ArgumentsDelta(index, call.arguments)]
        self._close(call)

    def _close(self, call: ToolCall) -> None:
        self._events.append(CallClosed(len(self.calls), call))
        self.calls.append(call)

    def _take(self) -> list[Event]:
        out: list[Event] = []
        for e in self._events:
            last = out[-1] if out else None
            if isinstance(e, TextDelta) and isinstance(last, TextDelta):
                out[-1] = TextDelta(last.text + e.text)
            elif isinstance(e, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == e.index:
                out[-1] = ArgumentsDelta(e.index, last.text + e.text)
            elif not (isinstance(e, ArgumentsDelta) and not e.text):
                out.append(e)
        self._events = []
        return out


class HermesStream(ToolStream):
    """Hermes blocks, arguments forwarded as written (see the module docstring).

    States: ``text`` (content, looking for ``<tool_call>``), ``head`` (the
    block's start, until the name and the start of the arguments are read),
    ``whole`` (a block that cannot stream: held to its end), ``args`` (the
    arguments object, forwarded), ``tail`` (after the arguments, up to
    ``</tool_call>``).
    """

    START, END = HermesParser.start, HermesParser.end

    def __init__(self, parser: HermesParser) -> None:
        super().__init__(parser)
        self._mode = "text"
        self._buf = ""  # text not yet consumed in the current mode
        self._call: ToolCall | None = None
        self._scanner = ObjectScanner()

    def _feed(self, delta: str) -> None:
        self._buf += delta
        step = {"text": self._in_text, "head": self._in_head, "whole": self._in_head,
                "args": self._in_args, "tail": self._in_tail}
        while step[self._mode]():
            pass

    def _in_text(self) -> bool:
        i = self._buf.find(self.START)
        if i >= 0:
            self._text(self._buf[:i])
            self._buf, self._mode = self._buf[i + len(self.START):], "head"
            return True
        keep = len(self._buf) - partial_suffix(self._buf, self.START)
        self._text(self._buf[:keep])
        self._buf = self._buf[keep:]
        return False

    def _in_head(self) -> bool:
        block = self._buf
        end = block.find(self.END)
        if end >= 0:
            self._block_whole(block[:end], closed=True)
            self._buf, self._mode = block[end + len(self.END):], "text"
            return True
        head = HERMES_HEAD.match(block) if self._mode == "head" else None
        if head is None or head.end() == len(block):
            return False
        if block[head.end()] != "{":
            self._mode = "whole"
            return False
        self._call = ToolCall(json.loads(head.group(1)), "")
        self._events.append(CallOpened(len(self.calls), self._call.id, self._call.name))
        self._buf, self._mode, self._scanner = block[head.end():], "args", ObjectScanner()
        return True

    def _in_args(self) -> bool:
        end = self._buf.find(self.END)
        region = self._buf[:end] if end >= 0 else self._buf[:len(self._buf) - partial_suffix(self._buf, self.END)]
        done = self._scanner.feed(region)
        taken = region if done is None else region[:done]
        self._arguments(taken)
        self._buf = self._buf[len(taken):]
        if done is not None:
            self._mode = "tail"
            return True
        if end >= 0:  # the block closed inside the arguments: the call stays as streamed
            self._close_call()
            self._buf, self._mode = self._buf[len(self.END):], "text"
            return True
        return False

    def _in_tail(self) -> bool:
        end = self._buf.find(self.END)
        if end < 0:
            return False
        self._close_call()
        self._buf, self._mode = self._buf[end + len(self.END):], "text"
        return True

    def _finish(self) -> None:
        if self._mode == "text":
            self._text(self._buf)
        elif self._mode in ("head", "whole"):
            self._block_whole(self._buf, closed=False)
        else:
            if self._mode == "args":
                self._arguments(self._buf)
            self._close_call()
        self._buf = ""

    def _arguments(self, text: str) -> None:
        self._call.arguments += text
        self._events.append(ArgumentsDelta(len(self.calls), text))

    def _close_call(self) -> None:
        call, self._call = self._call, None
        self._close(call)

    def _block_whole(self, block: str, closed: bool) -> None:
        call = hermes_call(block)
        if call is not None:
            self._whole_call(call)
        else:
            self._text(self.START + block + (self.END if closed else ""))


class WholeCallStream(ToolStream):
    """Content streamed up to the call marker; the calls sent whole at the end
    (the fallback for formats that do not stream, see the module docstring)."""

    def __init__(self, parser: ToolParser) -> None:
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
