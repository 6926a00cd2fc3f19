"""XML-like call parameters (Qwen3-Coder's ``<parameter=k>v</parameter>``, GLM's
``<arg_key>k</arg_key><arg_value>v</arg_value>``) read into a JSON arguments object.

:class:`ParamReader` reads the text after a call's name, a piece at a time,
and writes the arguments object's JSON as each parameter completes
(``{"k": v``, then ``, "k2": v2``, then ``}`` at the call's end marker). A
value is the text between its markers less one leading and one trailing
newline, converted by the type the tool's schema gives the parameter
(:func:`param_value`): a ``string`` stays the text as written (``123``,
``true``, ``null``, ``[1]`` included); ``integer``, ``number``, ``boolean``,
``object``, ``array`` and ``null`` are read from the text, which stays a
string when it is not one; a parameter the schema does not type (or a tool
the request did not send) is JSON when the text reads as JSON, else a string
(a syntax that types its values, DeepSeek DSML's ``string="true"``, decides
there instead).
The schemas come from the request (:func:`param_schemas`), so a stream and a
whole parse of one output read the same values.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field

from quanta.server.tool_formats.calls import parse_json


@dataclass(frozen=True)
class ParamSyntax:
    key_open: str
    key_close: str
    value_open: str
    value_close: str
    #: the marker that ends the call's parameters
    end: str
    #: value-open markers (instead of ``value_open``) that type the value where the request's schema
    #: does not: DeepSeek DSML's ``string="true">`` (a string) and ``string="false">`` (JSON)
    typed_opens: tuple[tuple[str, dict | None], ...] = ()
    #: one leading and one trailing newline around a value belong to the syntax
    trim: bool = True

    @property
    def starts(self) -> tuple[str, str]:
        """Markers that may directly follow the name (not consumed with it)."""
        return self.key_open, self.end


def param_schemas(tools: list[dict] | None) -> dict[str, dict[str, dict]]:
    """Tool name -> parameter name -> that parameter's JSON schema, for OpenAI-shaped ``tools``."""
    out: dict[str, dict[str, dict]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        params = fn.get("parameters") if isinstance(fn, dict) else None
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(fn.get("name") if isinstance(fn, dict) else None, str) and isinstance(props, dict):
            out[fn["name"]] = {k: v for k, v in props.items() if isinstance(v, dict)}
    return out


def schema_types(schema: dict | None) -> list[str]:
    """The JSON types a parameter's schema allows (``type``, a list of them, ``anyOf``/``oneOf``
    members' types; an ``enum`` of strings alone is ``string``), in the schema's order."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return [k for member in schema[key] for k in schema_types(member)]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return ["string"]
    return []


def _number(text: str, whole: bool):
    value = parse_json(text)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _MISSING
    if whole:
        return value if isinstance(value, int) else (int(value) if value.is_integer() else _MISSING)
    return value


def _container(text: str, kind: type):
    value = parse_json(text)
    if value is None and text[:1] in "[{":  # Python literals (single quotes, True/None) as models write them
        try:
            value = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            value = None
    return value if isinstance(value, kind) else _MISSING


_MISSING = object()
#: type names schemas write for JSON's (Python's and others')
_ALIASES = {"int": "integer", "float": "number", "bool": "boolean", "dict": "object", "list": "array"}
_READERS = {
    "integer": lambda t: _number(t, True),
    "number": lambda t: _number(t, False),
    "boolean": lambda t: {"true": True, "false": False}.get(t.lower(), _MISSING),
    "null": lambda t: None if t == "null" else _MISSING,
    "object": lambda t: _container(t, dict),
    "array": lambda t: _container(t, list),
}


def param_value(text: str, schema: dict | None = None, trim: bool = True):
    """A parameter's value from its text (see the module docstring); ``schema``: the parameter's;
    ``trim``: one leading and one trailing newline are not the value's. A value JSON cannot
    write (``NaN``, ``Infinity``) stays the text."""
    if trim:
        text = text.removeprefix("\n").removesuffix("\n")
    value = _typed(text, schema_types(schema))
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError):
        return text
    return value


def _typed(text: str, kinds: list[str]):
    if not kinds:
        value = parse_json(text)
        return text if value is None else value
    for kind in kinds:
        read = _READERS.get(_ALIASES.get(kind, kind))
        value = read(text.strip()) if read else _MISSING
        if value is not _MISSING:
            return value
    return text


@dataclass
class ParamReader:
    """Reads one call's parameters (see the module docstring)."""

    syntax: ParamSyntax
    #: parameter name -> its JSON schema (the called tool's, :func:`param_schemas`)
    schemas: dict[str, dict] = field(default_factory=dict)
    state: str = "key_wait"  # key_wait, key, value_wait, value
    key: str = ""
    #: the schema the value's open marker gives (:attr:`ParamSyntax.typed_opens`)
    given: dict | None = None
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
        typed = dict(self.syntax.typed_opens)
        opens = tuple(typed) or ((self.syntax.value_open,) if self.syntax.value_open else ())
        if opens:
            found = self._expect(rest, opens, final)
            if not found:
                return found
            self.given = typed.get(found)
        self.state = "value"
        return True

    def _value(self, rest: str, final: bool):
        value = self._read_to(rest, self.syntax.value_close)
        if value is None:
            return None
        schema = self.schemas.get(self.key)
        schema = schema if schema_types(schema) else self.given
        head = "{" if self.count == 0 else ", "
        self.out.append(head + json.dumps(self.key, ensure_ascii=False) + ": "
                        + json.dumps(param_value(value, schema, self.syntax.trim), ensure_ascii=False))
        self.count += 1
        self.state = "key_wait"
        return True
