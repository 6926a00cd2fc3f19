"""Reasoning written before the answer (``<think>...</think>`` and its kin), split from content.

A :class:`ReasoningSyntax` names the two markers. Reasoning is the text from
the start marker (only at the very start of the output, after whitespace) to
the end marker; when the prompt already ended with the start marker (a
template that opens thinking for the model, :func:`prompt_opens`) the output
begins inside it. An output that never writes the end marker is reasoning
throughout. Whitespace around the reasoning and at the start of the content
after it is dropped. The rest of the output goes to the tool-call format.

:class:`Splitter` reads pieces of any size and says nothing until the text so
far decides it, so :class:`ReasoningParser` (a finished output) and
:class:`ReasoningStream` (deltas; :class:`ReasoningDelta` events ahead of the
tool format's events) agree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from quanta.server.tool_formats.base import ToolParser
from quanta.server.tool_formats.calls import Parsed
from quanta.server.tool_formats.scan import partial_suffix
from quanta.server.tool_formats.stream import ReasoningDelta, ToolStream


@dataclass(frozen=True)
class ReasoningSyntax:
    name: str
    start: str
    end: str


THINK = ("<think>", "</think>")
REASONING: dict[str, ReasoningSyntax] = {s.name: s for s in (
    ReasoningSyntax("deepseek_r1", *THINK), ReasoningSyntax("qwen3", *THINK), ReasoningSyntax("glm45", *THINK),
    ReasoningSyntax("kimi_k2", *THINK), ReasoningSyntax("granite", *THINK),
    ReasoningSyntax("mistral", "[THINK]", "[/THINK]"),
    ReasoningSyntax("seed_oss", "<seed:think>", "</seed:think>"),
    ReasoningSyntax("command_r", "<|START_THINKING|>", "<|END_THINKING|>"),
)}


def prompt_opens(prompt_tail: str, syntax: ReasoningSyntax) -> bool:
    """Whether a prompt ending with ``prompt_tail`` (its last tokens' text, special
    tokens kept) leaves the model inside reasoning."""
    return prompt_tail.rstrip().endswith(syntax.start)


class Splitter:
    """Splits one output into reasoning and content pieces (see the module docstring)."""

    def __init__(self, syntax: ReasoningSyntax, opened: bool) -> None:
        self.syntax = syntax
        self.state = "reasoning_lead" if opened else "lead"
        self.buf = ""
        self.space = ""  # trailing whitespace of the reasoning, held until more reasoning follows
        self.out: list[tuple[str, str]] = []

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        """``("reasoning" | "content", text)`` pieces the text so far decides."""
        self.buf += text
        while getattr(self, "_" + self.state)(final):
            pass
        out, self.out = self.out, []
        return out

    def _lead(self, final: bool) -> bool:
        lead = self.buf.lstrip()
        if lead.startswith(self.syntax.start):
            self.buf, self.state = lead[len(self.syntax.start):], "reasoning_lead"
            return True
        if not final and self.syntax.start.startswith(lead):
            return False
        self.state = "content"
        return True

    def _reasoning_lead(self, final: bool) -> bool:
        self.buf = self.buf.lstrip()
        if self.buf or final:
            self.state = "reasoning"
            return True
        return False

    def _reasoning(self, final: bool) -> bool:
        i = self.buf.find(self.syntax.end)
        if i >= 0:
            self._reason(self.buf[:i])
            self.buf, self.state = self.buf[i + len(self.syntax.end):], "content_lead"
            return True
        keep = len(self.buf) - (0 if final else partial_suffix(self.buf, self.syntax.end))
        self._reason(self.buf[:keep])
        self.buf = self.buf[keep:]
        return False

    def _reason(self, text: str) -> None:
        body = text.rstrip()
        if body:
            self.out.append(("reasoning", self.space + body))
            self.space = ""
        self.space += text[len(body):]

    def _content_lead(self, final: bool) -> bool:
        self.buf = self.buf.lstrip()
        if self.buf:
            self.state = "content"
            return True
        return False

    def _content(self, final: bool) -> bool:
        if self.buf:
            self.out.append(("content", self.buf))
            self.buf = ""
        return False


class ReasoningParser(ToolParser):
    """A tool format (``inner``) behind a reasoning splitter."""

    def __init__(self, inner: ToolParser, syntax: ReasoningSyntax, opened: bool = False) -> None:
        self.inner, self.syntax, self.opened = inner, syntax, opened
        self.name = inner.name

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content text) of a finished output."""
        pieces = Splitter(self.syntax, self.opened).feed(text, final=True)
        reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
        return reasoning or None, "".join(t for kind, t in pieces if kind == "content")

    def parse(self, text: str) -> Parsed:
        reasoning, content = self.split(text)
        return replace(self.inner.parse(content), reasoning=reasoning)

    @property
    def markers(self) -> tuple[str, ...]:
        return (*self.inner.markers, self.syntax.start, self.syntax.end)

    def forced_call(self, lark, tools, parallel) -> str:
        """The inner format's forced calls after the reasoning (:meth:`after_reasoning`)."""
        return self.after_reasoning(lark, self.inner.forced_call(lark, tools, parallel))

    def after_reasoning(self, lark, answer: str) -> str:
        """The Lark expression ``answer`` after the reasoning: its end marker first when the
        prompt opened it, else an optional whole reasoning block."""
        thought = f'{lark.until(self.syntax.end)} ("\\n" | "\\n\\n")?'
        if self.opened:
            return f"{thought} {answer}"
        return f"({lark.marks.lit(self.syntax.start)} {thought})? {answer}"

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """A :class:`ToolStream` of the inner format, fed the content the splitter lets through."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.inner: ToolStream = parser.inner.stream()
        self._splitter = Splitter(parser.syntax, parser.opened)

    @property
    def calls(self):
        return self.inner.calls

    @property
    def broken(self) -> bool:
        return self.inner.broken

    @property
    def made_calls(self) -> bool:
        return self.inner.made_calls

    def feed(self, delta: str) -> list:
        return self._route(self._splitter.feed(delta))

    def finish(self) -> list:
        return self._route(self._splitter.feed("", final=True)) + self.inner.finish()

    def _route(self, pieces: list[tuple[str, str]]) -> list:
        events: list = []
        for kind, text in pieces:
            events += [ReasoningDelta(text)] if kind == "reasoning" else self.inner.feed(text)
        return events
