"""XML-like call parameters (Qwen3-Coder's ``<parameter=k>v</parameter>``, GLM's
``<arg_key>k</arg_key><arg_value>v</arg_value>``) read into a JSON arguments object.

:class:`ParamReader` reads the text after a call's name, a piece at a time,
and writes the arguments object's JSON as each parameter completes
(``{"k": v``, then ``, "k2": v2``, then ``}`` at the call's end marker). A
value is the text between its markers less one leading and one trailing
newline; it is JSON when it reads as JSON (``1``, ``true``, ``[1, 2]``)
unless the tool's schema says the parameter is a string, else a string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from quanta.server.tools import parse_json


@dataclass(frozen=True)
class ParamSyntax:
    key_open: str
    key_close: str
    value_open: str
    value_close: str
    #: the marker that ends the call's parameters
    end: str

    @property
    def starts(self) -> tuple[str, str]:
        """Markers that may directly follow the name (not consumed with it)."""
        return self.key_open, self.end


def param_value(text: str, kind: str | None):
    """A parameter's value from its text (see the module docstring); ``kind``: the schema's ``type``."""
    text = text.removeprefix("\n").removesuffix("\n")
    if kind == "string":
        return text
    value = parse_json(text)
    return text if value is None else value


@dataclass
class ParamReader:
    """Reads one call's parameters (see the module docstring)."""

    syntax: ParamSyntax
    #: parameter name -> its JSON-schema ``type`` (strings stay strings)
    types: dict[str, str] = field(default_factory=dict)
    state: str = "key_wait"  # key_wait, key, value_wait, value
    key: str = ""
    count: int = 0
    consumed: int = 0  # how much of the text given to the last feed was read
    out: list[str] = field(default_factory=list)

    def take(self) -> list[str]:
        out, self.out = self.out, []
        return out

    def feed(self, text: str, final: bool) -> bool | None:
        """Read from ``text`` (all text after what was consumed before); None: not done yet,
        True: the parameters ended at the end marker, False: they did not end as they should."""
        self.consumed = 0
        while True:
            rest = text[self.consumed:]
            result = getattr(self, "_" + self.state)(rest, final)
            if result is not True:
                return None if result is None and not final else (False if result is None else result)
            if self.state == "done":
                return True

    def _expect(self, rest: str, markers: tuple[str, ...], final: bool):
        """The marker ``rest`` starts with after whitespace (consumed), None to wait, or False."""
        lead = rest.lstrip()
        for m in markers:
            if lead.startswith(m):
                self.consumed += len(rest) - len(lead) + len(m)
                return m
        if not final and (not lead or any(m.startswith(lead) for m in markers)):
            return None
        return False

    def _key_wait(self, rest: str, final: bool):
        found = self._expect(rest, (self.syntax.key_open, self.syntax.end), final)
        if not found:
            return found
        if found == self.syntax.end:
            self.out.append("}" if self.count else "{}")
            self.state = "done"
        else:
            self.state = "key"
        return True

    def _read_to(self, rest: str, marker: str):
        i = rest.find(marker)
        if i < 0:
            return None
        self.consumed += i + len(marker)
        return rest[:i]

    def _key(self, rest: str, final: bool):
        key = self._read_to(rest, self.syntax.key_close)
        if key is None:
            return None
        self.key, self.state = key.strip(), "value_wait"
        return True

    def _value_wait(self, rest: str, final: bool):
        if self.syntax.value_open:
            found = self._expect(rest, (self.syntax.value_open,), final)
            if not found:
                return found
        self.state = "value"
        return True

    def _value(self, rest: str, final: bool):
        value = self._read_to(rest, self.syntax.value_close)
        if value is None:
            return None
        head = "{" if self.count == 0 else ", "
        self.out.append(head + json.dumps(self.key, ensure_ascii=False) + ": "
                        + json.dumps(param_value(value, self.types.get(self.key)), ensure_ascii=False))
        self.count += 1
        self.state = "key_wait"
        return True
