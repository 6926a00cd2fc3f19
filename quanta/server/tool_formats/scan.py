"""Where a JSON object, and a Hermes ``<tool_call>`` block, end in model output
read piece by piece: the scanners :class:`quanta.server.tool_formats.base.HermesParser`
and :mod:`quanta.server.tool_formats.stream` share, so the parser and the stream
agree on every block's end; and how much of a text's tail could still begin a
marker (:func:`partial_suffix`).
"""

from __future__ import annotations


class ObjectScanner:
    """Finds where a JSON object ends in text fed piece by piece.

    The first character fed must be its ``{``. Brackets are counted outside
    strings (escapes honoured); the JSON is not otherwise validated.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """Consume ``text``; the offset in it just past the object's closing ``}``, or None if still open."""
        for i, ch in enumerate(text):
            if self.step(ch):
                return i + 1
        return None

    def step(self, ch: str) -> bool:
        """Consume one character; whether it closed the object."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


class BlockScanner:
    """Finds the ``</tool_call>`` that ends a Hermes block, in the text after
    ``<tool_call>`` fed piece by piece (each character once).

    While the block's leading JSON object (its first non-space character
    ``{``) is open, a marker inside one of its strings is string data;
    elsewhere the first marker ends the block. ``held`` is how many of the
    characters fed last may be the start of the marker (the stream holds
    them back).
    """

    END = "</tool_call>"

    def __init__(self) -> None:
        self.object: ObjectScanner | None = None  # set at the leading "{"; None before it
        self.lead = True  # only whitespace so far
        self.held = 0

    def feed(self, text: str) -> int | None:
        """Consume ``text``; the offset in it just past the ending marker, or None if not yet seen."""
        for i, ch in enumerate(text):
            if self.lead and not ch.isspace():
                self.lead = False
                self.object = ObjectScanner() if ch == "{" else None
            obj = self.object
            if obj is not None and obj.depth >= 0 and (obj.in_string or ch == '"'):
                obj.step(ch)
                self.held = 0
                continue
            if obj is not None and obj.depth >= 0 and obj.step(ch):
                obj.depth = -1  # closed: no more string tracking
            self.held = self.held + 1 if ch == self.END[self.held] else int(ch == self.END[0])
            if self.held == len(self.END):
                self.held = 0
                return i + 1
        return None


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
