"""The request body of OpenAI's Responses API (``POST /v1/responses``), under
:mod:`quanta.server.field_rule`, and what the route makes of it: the chat
messages, the function tools and the constraint.

Tools: ``function`` tools; ``namespace`` tools (a named group of function
tools, as Codex CLI sends its MCP tools) are flattened into function tools
named ``<namespace>.<name>``, and a call of one is answered in the
namespace's form (``name`` and ``namespace`` apart, :meth:`ResponsesRequest.call_name`);
earlier calls in ``input`` that carry a ``namespace`` are read the same way.
Hosted tools (``web_search``, ``file_search``, ``code_interpreter``, ...,
and ``custom`` tools, also inside a namespace) are accepted and never
called: quanta runs no tools, so the model answers without them (named in
the server log). A ``tool_choice`` that forces a hosted tool, or
``required`` with no function tool, is a 400.

Refused: ``previous_response_id``, ``conversation`` and ``prompt`` (stored
state: send the whole conversation), ``background: true`` and ``store: true``.
Accepted with no effect (logged): ``client_metadata``, ``reasoning`` (the
model does not reason), ``include`` (no item it names is produced; but
``message.output_text.logprobs`` is refused: the answer would lack them),
``context_management``, ``max_tool_calls``, ``top_logprobs`` and the other
documented fields (:data:`quanta.server.field_rule.OPENAI_RESPONSES`).
``ignore_eos``, ``top_k`` and ``min_p`` (vLLM's extensions, as on chat and
completions) are honoured. ``reasoning`` items in ``input`` (a conversation
from a reasoning model) are dropped, and logged: the model reads no reasoning.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from quanta.engine.sampling import SamplingParams
from quanta.server.errors import APIError
from quanta.server.field_rule import OPENAI_RESPONSES, FieldRule, field_error
from quanta.server.openai.requests import FEW_TOOLS, ResponseFormat, ToolSchema
from quanta.server.protocol import (
    NO_EFFECT_FIELDS,
    CacheSalt,
    NoEffect,
    NonEmptyText,
    ReasoningEffort,
    StrictFlag,
    UnicodeText,
    integer,
    number,
    only,
    turns,
)
from quanta.server.tool_formats.registry import forced_grammar, schema_grammar


def served(*kinds: str):
    """A ``type`` string whose served values the schema lists (the route names any other in its 400)."""
    return Annotated[str, Field(json_schema_extra={"enum": list(kinds)})]


class InputPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: served("input_text", "output_text", "text")
    text: str | None = None


class InputItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: served("message", "function_call", "function_call_output", "reasoning") = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: served("function")
    #: required (a forced call needs it), as OpenAI's chat tools spell it
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: UnicodeText | None = None
    parameters: ToolSchema | None = None
    strict: bool | None = None


class HostedTool(BaseModel):
    """A tool quanta does not run (``web_search``, ``custom``, ...): accepted, never called."""

    model_config = ConfigDict(extra="allow")
    type: str


def _kind(tool) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return {"function": "FunctionTool", "namespace": "NamespaceTool"}.get(kind, "HostedTool")


class NamespaceTool(BaseModel):
    """Function tools under a shared name; the model sees them as ``<namespace>.<name>``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["namespace"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: UnicodeText | None = None
    tools: Annotated[list[Annotated[Annotated[FunctionTool, Tag("FunctionTool")] | Annotated[HostedTool, Tag("HostedTool")],
                                    Discriminator(lambda t: "FunctionTool" if _kind(t) == "FunctionTool" else "HostedTool")]],
                     FEW_TOOLS]


AnyTool = Annotated[Annotated[FunctionTool, Tag("FunctionTool")] | Annotated[NamespaceTool, Tag("NamespaceTool")]
                    | Annotated[HostedTool, Tag("HostedTool")], Discriminator(_kind)]


class NamedChoice(BaseModel):
    type: Literal["function"]
    name: str
    namespace: str | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None


class Reasoning(BaseModel):
    """``reasoning`` as Codex-style clients send it: accepted, no effect (the model does not reason)."""

    model_config = ConfigDict(extra="forbid")
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(FieldRule, NoEffect):
    """``POST /v1/responses`` (see the module docstring)."""

    DOCUMENTED = OPENAI_RESPONSES
    RENAMED = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
               "response_format": "text.format"}
    NO_EFFECT = NO_EFFECT_FIELDS | {"include", "reasoning"}
    #: None (left out): the served model, as vLLM and llama-server default to it (:func:`quanta.server.defaults.served_model`)
    model: str | None = None
    input: NonEmptyText | turns(InputItem)
    instructions: str | None = None
    tools: Annotated[list[AnyTool], FEW_TOOLS] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    parallel_tool_calls: StrictFlag = True
    #: OpenAI's minimum is 16
    max_output_tokens: integer(ge=16) | None = None
    temperature: number(ge=0.0, le=2.0) | None = None
    top_p: number(gt=0.0, le=1.0) | None = None
    stream: StrictFlag = False
    text: TextOptions | None = None
    #: must be null (nothing is stored)
    previous_response_id: Any = Field(None, json_schema_extra={"type": "null"})
    conversation: Any = Field(None, json_schema_extra={"type": "null"})
    prompt: Any = Field(None, json_schema_extra={"type": "null"})
    background: only(None, False) = None
    cache_salt: CacheSalt | None = None
    ignore_eos: StrictFlag = False
    top_k: integer(ge=-1) = 0
    min_p: number(ge=0.0, le=1.0) = 0.0
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    truncation: only(None, "disabled") = None

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _stateless(cls, value):
        if value is not None:
            raise ValueError("responses are not stored; send the whole conversation in input instead")
        return value

    @field_validator("include")
    @classmethod
    def _no_logprobs(cls, include):
        for i, value in enumerate(include or []):
            if value == "message.output_text.logprobs":
                raise field_error(str(i), "output logprobs are not served on Responses; use chat completions' logprobs")
        return include

    @field_validator("prompt")
    @classmethod
    def _no_stored_prompt(cls, value):
        if value is not None:
            raise ValueError("stored prompts are not served; send instructions and input instead")
        return value

    @model_validator(mode="after")
    def _unique_names(self):
        seen: set[str] = set()
        for where, name, _ in self._flat():
            if name in seen:
                raise field_error(where, f"the tool name {name!r} is repeated; tool names must be unique")
            seen.add(name)
        return self

    def _flat(self) -> list[tuple[str, str, FunctionTool]]:
        """(where, the name the model sees, the tool) of every function tool, namespaces flattened."""
        out = []
        for i, tool in enumerate(self.tools or []):
            if isinstance(tool, FunctionTool):
                out.append((f"tools.{i}", tool.name, tool))
            elif isinstance(tool, NamespaceTool):
                out += [(f"tools.{i}.tools.{j}", f"{tool.name}.{t.name}", t)
                        for j, t in enumerate(tool.tools) if isinstance(t, FunctionTool)]
        return out

    def ignored_parts(self) -> list[str]:
        items = [] if isinstance(self.input, str) else self.input
        hosted = [f"input.{i} (reasoning)" for i, item in enumerate(items) if item.type == "reasoning"]
        hosted += [f"tools.{i} ({t.type})" for i, t in enumerate(self.tools or []) if isinstance(t, HostedTool)]
        for i, ns in enumerate(self.tools or []):
            if isinstance(ns, NamespaceTool):
                hosted += [f"tools.{i}.tools.{j} ({t.type})" for j, t in enumerate(ns.tools) if isinstance(t, HostedTool)]
        return hosted

    def chat_tools(self) -> list[dict]:
        """Function tools in chat's shape (namespaced ones under ``<namespace>.<name>``)."""
        return [{"type": "function", "function": {**t.model_dump(exclude_none=True, exclude={"type"}), "name": name}}
                for _, name, t in self._flat()]

    def call_name(self, name: str) -> dict:
        """``name`` and, for a namespaced tool, ``namespace`` of a call the model made to ``name``."""
        for tool in self.tools or []:
            if isinstance(tool, NamespaceTool) and name.startswith(tool.name + ".") and \
                    any(isinstance(t, FunctionTool) and t.name == name[len(tool.name) + 1:] for t in tool.tools):
                return {"name": name[len(tool.name) + 1:], "namespace": tool.name}
        return {"name": name}

    def messages(self) -> list[dict]:
        """The conversation as OpenAI chat messages (consecutive calls form one assistant turn)."""
        out: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [InputItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            if item.type == "message":
                out.append({"role": item.role or "user", "content": _text(item.content, f"input.{i}.content")})
            elif item.type == "function_call":
                name = f"{item.namespace}.{item.name}" if item.namespace else item.name
                call = {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": item.arguments or "{}"}}
                if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif item.type == "reasoning":
                continue  # named in ignored_parts
            elif item.type == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, f"input.{i}.output")})
            else:
                raise APIError(400, f"input.{i}: items of type {item.type!r} are not supported", f"input.{i}.type")
        return out

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=self.top_p or 1.0, top_k=self.top_k, min_p=self.min_p, cache_salt=self.cache_salt,
                              ignore_eos=self.ignore_eos)


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text", "text") or part.text is None:
            raise APIError(400, f"{where}.{j}: content of type {part.type!r} is not supported (text only)", f"{where}.{j}.type")
    return "".join(p.text for p in content)


def _forced(body: ResponsesRequest, tools: list[dict]) -> list[dict] | None:
    if body.tool_choice == "required":
        return tools
    if isinstance(body.tool_choice, NamedChoice):
        choice = body.tool_choice
        wanted = f"{choice.namespace}.{choice.name}" if choice.namespace else choice.name
        named = [t for t in tools if t["function"]["name"] == wanted] or \
            [t for t in tools if not choice.namespace and body.call_name(t["function"]["name"])["name"] == choice.name]
        if not named:
            raise APIError(400, f"tool_choice names {choice.name!r}, which is not among tools", "tool_choice")
        return named
    return None


def request_grammar(state, body: ResponsesRequest, tools: list[dict], prompt: list[int]):
    """(grammar, the field it enforces) of the request: a forced call, else ``text.format``, else (None, None).

    Raises:
        APIError: 400 for a ``tool_choice`` that forces a call without function tools.
    """
    forced = _forced(body, tools) if tools else None
    if forced:
        return forced_grammar(state, prompt, forced, body.parallel_tool_calls), "tool_choice"
    if body.tool_choice not in (None, "auto", "none") and not tools:
        raise APIError(400, "tool_choice requires function tools (hosted tools are not run here)", "tool_choice")
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type != "text":
        schema = {"schema": fmt.schema_ or {"type": "object"}} if fmt.type == "json_schema" else None
        return schema_grammar(state, prompt, ResponseFormat(type=fmt.type, json_schema=schema).schema()), "text.format"
    return None, None
