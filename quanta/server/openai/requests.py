"""The OpenAI request fields beyond sampling: tools, structured output,
logprobs, guided decoding, and the fields quanta refuses.

:class:`ChatRequest` and :class:`CompletionsRequest` extend the sampling
bodies of :mod:`quanta.server.protocol`. Every field is either honoured or
refused with HTTP 400 naming it: ``logit_bias``, ``echo``, ``suffix``,
``best_of`` > 1, ``n`` > 1, the legacy ``functions``/``function_call``,
audio, predicted outputs, web search and non-text content parts (images,
audio, files): answers that ignored them would not be the ones asked for.
Fields that change nothing about the output
(:class:`quanta.server.protocol.NoEffect`) are accepted; other fields follow
:mod:`quanta.server.field_rule`. A forced ``tool_choice`` with
``response_format`` is accepted: the forced call wins (a response format
governs a text answer), as OpenAI's API does. A message's ``content`` is null only on an assistant
turn, a ``tool`` message needs ``tool_call_id``, earlier calls' ``arguments``
must be JSON, tool names are unique and each ``parameters`` schema must
compile (whatever ``tool_choice`` is).

Guided decoding (vLLM's extension fields, sent with ``extra_body``):
``guided_json`` (a JSON schema), ``guided_regex``, ``guided_choice`` (a list of
strings); one constraint per request (a forced ``tool_choice`` with
``response_format`` counts as one: the call).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from quanta.engine.grammar import Grammar
from quanta.engine.grammar_bounds import MAX_REQUEST_SCHEMAS, check_schema
from quanta.server.limits import surrogate_problem
from quanta.server.protocol import ChatCompletionRequest, CompletionRequest, StrictFlag, UnicodeText, field_error, integer, turns

Role = Literal["system", "developer", "user", "assistant", "tool"]

#: refused field -> what to do instead (a value equal to the default is allowed)
_REFUSED = {
    "logit_bias": "logit_bias is not supported",
    "echo": "echo is not supported; the prompt is not returned",
    "suffix": "suffix (insertion) is not supported",
    "best_of": "best_of > 1 is not supported; send separate requests",
    "functions": "functions is not supported; use tools",
    "function_call": "function_call is not supported; use tool_choice",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs (prediction) are not supported",
    "web_search_options": "web search is not supported",
    "modalities": "only the text modality is supported",
}
_HARMLESS = (None, False, {}, [], "", 1, ["text"])


class _Refusals(BaseModel):
    """Fields that exist in OpenAI's API but not in quanta: any non-default value is a 400."""

    logit_bias: Any = Field(None, description=_REFUSED["logit_bias"])
    echo: Any = Field(None, description=_REFUSED["echo"])
    suffix: Any = Field(None, description=_REFUSED["suffix"])
    best_of: Any = Field(None, description=_REFUSED["best_of"])
    functions: Any = Field(None, description=_REFUSED["functions"])
    function_call: Any = Field(None, description=_REFUSED["function_call"])
    audio: Any = Field(None, description=_REFUSED["audio"])
    prediction: Any = Field(None, description=_REFUSED["prediction"])
    web_search_options: Any = Field(None, description=_REFUSED["web_search_options"])
    modalities: Any = Field(None, description=_REFUSED["modalities"])

    @field_validator(*_REFUSED, mode="before")
    @classmethod
    def _refuse(cls, value, info):
        if any(value == ok and type(value) is type(ok) for ok in _HARMLESS):
            return value
        raise ValueError(_REFUSED[info.field_name])


class _Guided(BaseModel):
    """vLLM's guided-decoding fields."""

    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None

    def guided_grammar(self) -> tuple[Grammar, str] | None:
        """(grammar, the field it came from) of the one guided field given, else None.

        Raises:
            ValueError: more than one guided field, or ``guided_json`` that is not JSON.
        """
        given = [f for f in ("guided_json", "guided_regex", "guided_choice") if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(f"give one guided decoding field, not {' and '.join(given)}")
        if not given:
            return None
        if self.guided_json is not None:
            return Grammar.json_schema(self.guided_json, "guided_json"), "guided_json"
        if self.guided_regex is not None:
            return Grammar.regex(self.guided_regex), "guided_regex"
        return Grammar.choice(self.guided_choice), "guided_choice"


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    #: the schema says text only; :meth:`Message._text_only` names the refused type
    type: Annotated[str, Field(json_schema_extra={"enum": ["text"]})]
    text: str | None = None


def schema_problem(schema: dict) -> str | None:
    """Why ``schema`` (a JSON schema) does not compile, else None (~1 ms; no tokenizer needed)."""
    import llguidance

    check_schema(schema)  # its size first (a 400 naming the bound)
    compiled = llguidance.LLMatcher.grammar_from_lark(Grammar.json_schema(schema).lark)
    problem = llguidance.LLMatcher.validate_grammar(compiled, None)
    if not problem or problem.startswith("WARNING"):
        return None
    return problem.split("\n", 1)[0].split(": ", 1)[-1]


def unique_names(names: list[str]) -> None:
    """Raise a :func:`field_error` naming index ``i`` (under ``tools``) at the first repeated name."""
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise field_error(str(i), f"the tool name {name!r} is repeated; tool names must be unique")
        seen.add(name)


def _usable(schema: dict) -> dict:
    problem = schema_problem(schema) or surrogate_problem(json.dumps(schema, ensure_ascii=False))
    if problem:
        raise ValueError(f"not a usable JSON schema: {problem}")
    return schema


#: a tool's ``parameters``: a JSON schema that compiles, checked whatever ``tool_choice`` is
ToolSchema = Annotated[dict, AfterValidator(_usable)]


def _bounded_tools(tools):
    """``tools`` unchanged; more than :data:`MAX_REQUEST_SCHEMAS` are refused by their number alone."""
    if isinstance(tools, list) and len(tools) > MAX_REQUEST_SCHEMAS:
        raise ValueError(f"{len(tools)} tools; at most {MAX_REQUEST_SCHEMAS} are accepted")
    return tools


#: a before-validator of a tools list: its length is bounded before any tool's schema compiles
FEW_TOOLS = BeforeValidator(_bounded_tools)


def unique_tools(name):
    """An after-validator of a tools list: 400 naming ``tools.<i>`` at the first repeated ``name(tool)``."""
    def check(tools):
        unique_names([name(t) for t in tools])
        return tools
    return AfterValidator(check)


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"

    @field_validator("arguments")
    @classmethod
    def _json(cls, arguments: str) -> str:
        try:
            json.loads(arguments)
        except ValueError as exc:
            raise ValueError(f"arguments is not valid JSON ({exc})") from None
        return arguments


class ToolCallIn(BaseModel):
    """An ``assistant`` message's earlier call."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    #: an earlier assistant turn's reasoning, handed to the chat template (which may write or drop it)
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        if isinstance(content, list):
            for i, part in enumerate(content):
                if part.type != "text":
                    raise ValueError(f"part {i}: content parts of type {part.type!r} are not supported (text only)")
                if part.text is None:
                    raise ValueError(f"part {i}: a text part needs text (it is missing)")
        return content

    @model_validator(mode="after")
    def _complete(self):
        if self.content is None and self.role != "assistant":
            raise field_error("content", f"a {self.role} message needs content (null only on assistant turns)")
        if self.role == "tool" and self.tool_call_id is None:
            raise field_error("tool_call_id", "a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def as_dict(self) -> dict:
        """The OpenAI-shaped dict :func:`quanta.server.tool_formats.base.render_for_template` takes."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None and self.role == "assistant":
            out["reasoning_content"] = self.reasoning_content
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


class FunctionDef(BaseModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: UnicodeText | None = None
    parameters: ToolSchema | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class _Named(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: _Named


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self

    def schema(self) -> dict | None:
        """The JSON schema the answer must match (``json_object``: any object); None for text.
        The route makes it a grammar after any reasoning (``schema_grammar``)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            return self.json_schema.schema_
        return None


class ChatRequest(_Refusals, _Guided, ChatCompletionRequest):
    """``POST /v1/chat/completions`` with tools, ``response_format`` and logprobs."""

    messages: turns(Message)
    tools: Annotated[list[Tool], FEW_TOOLS, unique_tools(lambda t: t.function.name)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictFlag = True
    response_format: ResponseFormat | None = None
    logprobs: StrictFlag = False
    top_logprobs: integer(ge=0, le=20) | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "needs logprobs: true")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise field_error("tool_choice", "tool_choice requires tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise field_error("tool_choice", f"tool_choice names {choice.function.name!r}, which is not among tools")
        given = [f for f in ("guided_json", "guided_regex", "guided_choice") if getattr(self, f) is not None]
        if choice == "required" or isinstance(choice, NamedToolChoice):
            given.insert(0, "tool_choice")  # with response_format too: the forced call wins
        elif self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise field_error(given[1], "give one constraint: a forced tool_choice, response_format or a guided_* field, "
                              f"not {' and '.join(given)}")
        return self

    @property
    def use_tools(self) -> bool:
        """Tools reach the prompt and the output is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tools(self) -> list[dict] | None:
        """The tools a call must be made from (``required``: all; named: that one), else None."""
        if self.tool_choice == "required":
            return [t.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t.model_dump(exclude_none=True) for t in self.tools if t.function.name == self.tool_choice.function.name]
        return None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionsRequest(_Refusals, _Guided, CompletionRequest):
    """``POST /v1/completions`` with ``logprobs`` (0-5 alternatives)."""

    logprobs: integer(ge=0, le=5) | None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs
