"""gpt-oss's harmony format (``openai``): messages on channels, read as they stream.

The prompt ends with ``<|start|>assistant``; the output is one or more
messages, each a header and a body:
``[ to=functions.NAME]<|channel|>CHANNEL[ to=functions.NAME][ <|constrain|>json]<|message|>BODY``,
the body ending at ``<|end|>``, ``<|call|>``, ``<|return|>`` or the output's
end; a later message starts with ``<|start|>assistant``. A body addressed
``to=functions.NAME`` is a call whose arguments are the body (a JSON object,
forwarded as written); otherwise the ``analysis`` channel is reasoning and
``final`` / ``commentary`` are content. An output that does not start as a
header is content throughout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quanta.server.tool_formats.base import ToolParser
from quanta.server.tool_formats.calls import Parsed, parse_json
from quanta.server.tool_formats.marked import MarkedStream, ModeMachine, Pieces, Sink, first_marker, held_tail, run_sink

MESSAGE, CHANNEL, START = "<|message|>", "<|channel|>", "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", START)
HEADS = (START, CHANNEL, " to=", "to=")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


@dataclass
class HarmonyMachine(ModeMachine):
    sink: Sink
    mode: str = "header"  # header, body, plain
    buf: str = ""
    kind: str = ""  # the body's: reasoning, content, call
    raw: str = ""
    args: str = ""

    def finish(self) -> None:
        self._run(True)
        if self.buf:
            self.sink.text(self.buf)
        self.buf = ""

    def _plain(self, final: bool) -> bool:
        if self.buf:
            self.sink.text(self.buf)
            self.buf = ""
        return False

    def _header(self, final: bool) -> bool:
        lead = self.buf.lstrip()
        i = lead.find(MESSAGE)
        if i < 0:
            could = any(lead.startswith(h) or h.startswith(lead) for h in HEADS)
            if not final and could and len(lead) < 512:
                return False
            self.mode = "plain" if self.buf.strip() else "header"
            return self.mode == "plain"
        header = lead[:i]
        if not any(header.startswith(h) for h in HEADS):
            self.mode = "plain"
            return True
        recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
        self.buf, self.mode, self.raw = lead[i + len(MESSAGE):], "body", lead[:i + len(MESSAGE)]
        if recipient:
            self.kind, self.args = "call", ""
            self.sink.open(recipient.group(1), None)
        else:
            self.kind = "reasoning" if channel and channel.group(1) == "analysis" else "content"
        return True

    def _body(self, final: bool) -> bool:
        i, marker = first_marker(self.buf, ENDS)
        end = i if i >= 0 else len(self.buf) - (0 if final else held_tail(self.buf, ENDS))
        self._emit(self.buf[:end])
        self.buf = self.buf[end:]
        if i < 0 and not final:
            return False
        self.buf = self.buf[len(marker):] if marker != START else self.buf
        if self.kind == "call":  # <|call|> is an end-of-turn token: the output may end right after the body
            self.sink.close(isinstance(parse_json(self.args), dict), self.raw)
        self.mode = "header"
        return i >= 0

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self.kind == "call":
            self.args += text
            self.raw += text
            self.sink.args(text)
        elif self.kind == "reasoning":
            self.sink.reasoning(text)
        else:
            self.sink.text(text)


class HarmonyParser(ToolParser):
    """gpt-oss harmony (see the module docstring); reasoning comes with it."""

    name, start = "openai", "<|channel|>"
    reasons = True
    markers = (MESSAGE, CHANNEL, START, "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")

    def parse(self, text: str) -> Parsed:
        sink = Pieces()
        return run_sink(HarmonyMachine(sink), sink, text)

    def stream(self) -> MarkedStream:
        return MarkedStream(self, HarmonyMachine)
