"""Size bounds on grammars, checked before anything compiles them.

A client's schema, regex or choice list costs compile time (llguidance's
grammar build and first mask grow faster than linearly with the number of
optional properties: 2,000 take ~0.5 s here, 5,000 ~3 s and then fail at the
next token on llguidance's row limit) and a schema nested deeply enough
overflows every recursive walk of it. So a grammar is measured first, by
iterative walks that stop at the first bound crossed (their cost is bounded
by the bounds, not by the input), and refused with a message naming the
bound:

* :data:`MAX_GRAMMAR_CHARS`: the grammar's text, embedded schemas included
  (a ``guided_json`` string is measured before it is parsed);
* :data:`MAX_SCHEMA_DEPTH`: nesting of a schema's JSON document (objects and
  arrays), so that ``$ref`` resolution, the termination check
  (:func:`quanta.engine.grammar.never_terminates`) and JSON parsing never
  recurse deeper;
* :data:`MAX_SCHEMA_PROPERTIES`: ``properties`` entries over all schemas of
  one grammar (a forced tool call embeds every tool's parameters);
* :data:`MAX_ENUM_VALUES`: ``enum`` values over all schemas of one grammar;
* :data:`MAX_SCHEMA_NODES`: objects and arrays over all schemas of one
  grammar (``anyOf`` lists of subschemas, ``prefixItems``, ...);
* :data:`MAX_CHOICES`: options of a choice grammar (``guided_choice``).
"""

from __future__ import annotations

import json
import re

#: Characters of a grammar's text (Lark, embedded JSON schemas included).
MAX_GRAMMAR_CHARS = 256 * 1024
#: Nesting of a JSON schema's document (each object or array is one level).
MAX_SCHEMA_DEPTH = 64
#: ``properties`` entries, over all the schemas of one grammar.
MAX_SCHEMA_PROPERTIES = 1000
#: ``enum`` values, over all the schemas of one grammar.
MAX_ENUM_VALUES = 1000
#: Objects and arrays, over all the schemas of one grammar.
MAX_SCHEMA_NODES = 5000
#: Options of a choice grammar.
MAX_CHOICES = 1000

#: A JSON string literal, or one bracket.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


class GrammarTooLarge(ValueError):
    """A grammar over one of the bounds of :mod:`quanta.engine.grammar_bounds`; the message names it."""


def load_schema(text: str):
    """The JSON value of schema ``text``, after its length and nesting are checked without recursion.

    Raises:
        GrammarTooLarge: over :data:`MAX_GRAMMAR_CHARS` or :data:`MAX_SCHEMA_DEPTH`.
        ValueError: not JSON.
    """
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarTooLarge(f"the schema has {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are accepted")
    depth = 0
    for match in _JSON_TOKEN.finditer(text):
        bracket = match.group()
        if bracket in "[{":
            depth += 1
            if depth > MAX_SCHEMA_DEPTH:
                raise GrammarTooLarge(_too_deep())
        elif bracket in "]}":
            depth -= 1
    return json.loads(text)


def check_choices(count: int) -> None:
    """Raise :class:`GrammarTooLarge` beyond :data:`MAX_CHOICES` options."""
    if count > MAX_CHOICES:
        raise GrammarTooLarge(f"{count} options; at most {MAX_CHOICES} are accepted")


def check_grammar(lark: str, schemas) -> None:
    """Check a grammar's text and its embedded ``schemas`` (totals over all of them).

    Raises:
        GrammarTooLarge: naming the first bound crossed.
    """
    if len(lark) > MAX_GRAMMAR_CHARS:
        raise GrammarTooLarge(f"the grammar has {len(lark)} characters (schemas included); "
                              f"at most {MAX_GRAMMAR_CHARS} are accepted")
    totals = _Totals()
    for schema in schemas:
        totals.add(schema)


def check_schema(schema) -> None:
    """Check one JSON schema (a parsed document) against the depth, property and enum bounds.

    Raises:
        GrammarTooLarge: naming the first bound crossed.
    """
    _Totals().add(schema)


class _Totals:
    """Properties and enum values counted over several schemas, each walked without recursion."""

    def __init__(self) -> None:
        self.properties = self.enum_values = self.nodes = 0

    def add(self, schema) -> None:
        stack = [(schema, 1)]
        while stack:
            node, depth = stack.pop()
            if depth > MAX_SCHEMA_DEPTH:
                raise GrammarTooLarge(_too_deep())
            self.nodes += 1
            if self.nodes > MAX_SCHEMA_NODES:
                raise GrammarTooLarge(f"the schema has more than {MAX_SCHEMA_NODES} objects and arrays")
            if isinstance(node, dict):
                props, enum = node.get("properties"), node.get("enum")
                if isinstance(props, dict):
                    self.properties += len(props)
                    if self.properties > MAX_SCHEMA_PROPERTIES:
                        raise GrammarTooLarge(f"the schema has more than {MAX_SCHEMA_PROPERTIES} properties "
                                              "(counted over all its objects)")
                if isinstance(enum, list):
                    self.enum_values += len(enum)
                    if self.enum_values > MAX_ENUM_VALUES:
                        raise GrammarTooLarge(f"the schema has more than {MAX_ENUM_VALUES} enum values "
                                              "(counted over all its enums)")
                stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
            elif isinstance(node, list):
                stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def _too_deep() -> str:
    return f"the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep (objects and arrays)"
