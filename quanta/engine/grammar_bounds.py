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
* :data:`MAX_CHOICES`: options of a choice grammar (``guided_choice``);
* :data:`MAX_REQUEST_SCHEMAS`: schemas one request has checked with
  :func:`check_schema` (tools' ``parameters``, each compiled as it is
  validated): the totals above then hold over all of them, once the server
  called :func:`count_request_schemas` for the request.
"""

from __future__ import annotations

import json
import re
from contextvars import ContextVar

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
#: Schemas checked for one request (OpenAI's API takes at most 128 tools).
MAX_REQUEST_SCHEMAS = 128

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


def count_request_schemas() -> None:
    """From here on in this context (one request), :func:`check_schema` counts every
    schema toward one set of totals, and at most :data:`MAX_REQUEST_SCHEMAS` schemas."""
    _REQUEST_TOTALS.set(_Totals("the request's schemas"))


def check_grammar(lark: str, schemas) -> None:
    """Check a grammar's text and its embedded ``schemas`` (totals over all of them).

    Raises:
        GrammarTooLarge: naming the first bound crossed.
    """
    if len(lark) > MAX_GRAMMAR_CHARS:
        raise GrammarTooLarge(f"the grammar has {len(lark)} characters (schemas included); "
                              f"at most {MAX_GRAMMAR_CHARS} are accepted")
    totals = _Totals("the grammar's schemas")
    for schema in schemas:
        totals.add(schema)


def check_schema(schema) -> None:
    """Check one JSON schema (a parsed document) against the depth, property, enum
    and object bounds (totals over the request's schemas: :func:`count_request_schemas`).

    Raises:
        GrammarTooLarge: naming the first bound crossed.
    """
    totals = _REQUEST_TOTALS.get()
    if totals is None:
        totals = _Totals("the schema")
    totals.schemas += 1
    if totals.schemas > MAX_REQUEST_SCHEMAS:
        raise GrammarTooLarge(f"more than {MAX_REQUEST_SCHEMAS} schemas (tools) in one request")
    totals.add(schema)


class _Totals:
    """Properties, enum values and objects counted over several schemas
    (``scope`` names them in messages), each walked without recursion."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self.properties = self.enum_values = self.nodes = self.schemas = 0

    def add(self, schema) -> None:
        stack = [(schema, 1)]
        while stack:
            node, depth = stack.pop()
            if depth > MAX_SCHEMA_DEPTH:
                raise GrammarTooLarge(_too_deep())
            self.nodes += 1
            if self.nodes > MAX_SCHEMA_NODES:
                raise GrammarTooLarge(f"more than {MAX_SCHEMA_NODES} objects and arrays (counted over {self.scope})")
            if isinstance(node, dict):
                props, enum = node.get("properties"), node.get("enum")
                if isinstance(props, dict):
                    self.properties += len(props)
                    if self.properties > MAX_SCHEMA_PROPERTIES:
                        raise GrammarTooLarge(f"more than {MAX_SCHEMA_PROPERTIES} properties (counted over {self.scope})")
                if isinstance(enum, list):
                    self.enum_values += len(enum)
                    if self.enum_values > MAX_ENUM_VALUES:
                        raise GrammarTooLarge(f"more than {MAX_ENUM_VALUES} enum values (counted over {self.scope})")
                stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
            elif isinstance(node, list):
                stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def _too_deep() -> str:
    return f"the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep (objects and arrays)"


#: The totals of the request being validated (:func:`count_request_schemas`); None: each schema alone.
_REQUEST_TOTALS: ContextVar[_Totals | None] = ContextVar("quanta_request_schema_totals", default=None)
