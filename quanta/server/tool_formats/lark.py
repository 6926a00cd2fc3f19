"""Pieces of the Lark grammars that force tool calls in a model's own syntax.

A format's markers are written as the model writes them: a marker that is
one added token of the vocabulary (gpt-oss ``<|channel|>``, Mistral's
``[TOOL_CALLS]`` in a tekken vocabulary, Qwen's ``<tool_call>``) as that
token (llguidance's ``<[id]>``: llguidance treats every added token as
special, and a special token never matches a quoted string), any other text
quoted. :class:`Marks` knows which markers are added tokens for one
tokenizer, and which of those decoding drops as special
(:func:`special_markers`); :class:`Lark` collects the rules of one grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # grammars load torch and llguidance: imported when one is written
    from quanta.engine.grammar import Grammar

#: characters a regex literal escapes
_REGEX_SPECIAL = set("\\^$.|?*+()[]{}/-")


def regex_literal(text: str) -> str:
    """``text`` as a literal inside a Lark ``/regex/``."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch in _REGEX_SPECIAL:
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


@dataclass(frozen=True)
class Marks:
    """Which markers are added tokens (marker -> id), which of those are special (dropped when
    decoding skips special tokens), and the end-of-sequence ids, for one tokenizer."""

    tokens: dict[str, int] = field(default_factory=dict)
    special: frozenset[str] = frozenset()
    eos: frozenset[int] = frozenset()

    def lit(self, text: str) -> str:
        """``text`` in a grammar: its added token, else the quoted string."""
        tid = self.tokens.get(text)
        return f"<[{tid}]>" if tid is not None else json.dumps(text)

    def ends_output(self, marker: str) -> bool:
        """Whether ``marker`` is an end-of-sequence token (a grammar cannot name one: it ends there)."""
        return self.tokens.get(marker) in self.eos

    def has(self, marker: str) -> bool:
        """Whether ``marker`` is one token of the vocabulary."""
        return marker in self.tokens


@lru_cache(maxsize=64)
def _marker_tokens(tokenizer, markers: tuple[str, ...]) -> tuple[tuple[str, int, bool], ...]:
    """(marker, id, special) for each of ``markers`` that is one added token of ``tokenizer``."""
    added = set(tokenizer.hf.added_tokens_decoder)
    found = []
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in added and tokenizer.decode(ids, skip_special_tokens=False) == marker:
            found.append((marker, ids[0], tokenizer.decode(ids, skip_special_tokens=True) == ""))
    return tuple(found)


def special_markers(tokenizer, markers: tuple[str, ...]) -> Marks:
    """:class:`Marks` of ``markers`` over ``tokenizer`` (a :class:`quanta.model.tokenizer.Tokenizer`)."""
    found = _marker_tokens(tokenizer, tuple(sorted(set(markers))))
    return Marks({m: i for m, i, _ in found}, frozenset(m for m, _, special in found if special),
                 frozenset(tokenizer.eos_token_ids))


class Marker(str):
    """A marker among the parts of :meth:`Lark.seq` (written as :meth:`Marks.lit` says)."""


class Lark:
    """One grammar's rules, named as they are added; :meth:`grammar` writes it."""

    def __init__(self, marks: Marks) -> None:
        self.marks = marks
        self._rules: list[str] = []
        self._count = 0

    def rule(self, body: str, lazy: bool = False) -> str:
        """A new rule matching ``body`` (``lazy``: its regex ends at the shortest match); its name."""
        self._count += 1
        name = f"r{self._count}"
        self._rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def seq(self, *parts: str) -> str:
        """``parts`` in sequence: a :class:`Marker` as :meth:`Marks.lit` writes it, others as they are."""
        return " ".join(self.marks.lit(p) if isinstance(p, Marker) else p for p in parts)

    def until(self, closer: str) -> str:
        """Free text up to and including the first ``closer`` (a special-token closer: any
        text without special tokens, then the token)."""
        if self.marks.has(closer):
            return f"/(?s:.*)/ {self.marks.lit(closer)}"
        return self.rule(f"/(?s:.*){regex_literal(closer)}/", lazy=True)

    def json(self, schema: dict) -> str:
        from quanta.engine.grammar import json_rule

        return json_rule(schema)

    def grammar(self, start: str) -> Grammar:
        from quanta.engine.grammar import Grammar

        return Grammar("\n".join([f"start: {start}", *self._rules]))


def tool_name(tool: dict) -> str:
    return tool["function"]["name"]


def tool_params(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def call_object(tool: dict, name_key: str = "name", args_key: str = "arguments", extra: dict | None = None) -> dict:
    """The schema of one call written as a JSON object: ``{name_key: NAME, args_key: {...}}``."""
    props = {**(extra or {}), name_key: {"const": tool_name(tool)}, args_key: tool_params(tool)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def calls_array(tools: list[dict], parallel: bool, **keys) -> dict:
    """The schema of a JSON array of calls of ``tools`` (one call unless ``parallel``)."""
    items = [call_object(t, **keys) for t in tools]
    array = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return array


def repeat(one: str, parallel: bool, sep: str = "") -> str:
    """``one`` once, or (``parallel``) one or more times separated by ``sep`` (quoted text)."""
    if not parallel:
        return f"({one})"
    glue = f"{json.dumps(sep)} " if sep else ""
    return f"({one}) ({glue}({one}))*"
