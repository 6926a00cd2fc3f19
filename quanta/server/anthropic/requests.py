"""Request bodies of Anthropic's Messages API (``/v1/messages`` and
``/v1/messages/count_tokens``), under :mod:`quanta.server.field_rule`.

Mapped or accepted with no effect, as the rule says:

- a ``system`` message inside ``messages`` (Claude Code sends one after the
  user's turn) is a system turn where the chat template allows it, else part
  of the system prompt (:mod:`quanta.server.system_turns`);
- ``output_config.format`` (``{"type": "json_schema", "schema": ...}``, what
  the SDK's ``messages.parse`` sends) is the JSON-schema constraint of
  OpenAI's ``response_format``; a forced ``tool_choice`` wins over it;
  ``output_config.effort`` has no effect;
- ``thinking`` of any type is accepted with no effect: a reasoning model
  reasons as its chat template has it (its reasoning is a thinking block),
  another model writes none;
- ``thinking`` blocks of earlier assistant turns are the message's
  ``reasoning_content`` (the chat template writes it where it writes
  reasoning, or drops it); ``redacted_thinking`` blocks are dropped;
- server tools (a ``type`` other than ``custom``: ``web_search_20250305``,
  ``bash_20250124``, ...) are accepted and never called: quanta runs no tools;
- ``context_management``, ``mcp_servers``, ``cache_control``, ``speed`` and
  the other documented fields (:data:`quanta.server.field_rule.ANTHROPIC_MESSAGES`)
  have no effect; ``metadata`` (``user_id``; its ``cache_salt`` is honoured)
  and ``service_tier`` too.

``container`` is refused unless null (it names stored state).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quanta.engine.sampling import SamplingParams
from quanta.server.anthropic.tools import THINKING_BLOCKS, AnthropicTool, ToolChoice
from quanta.server.errors import APIError
from quanta.server.field_rule import ANTHROPIC_MESSAGES, FieldRule
from quanta.server.openai.requests import FEW_TOOLS, unique_tools
from quanta.server.protocol import CacheSalt, NullMeansDefault, StopList, StrictFlag, check_stop_strings, integer, number, only, turns


class ContentBlock(BaseModel):
    """A content block: ``text``, ``tool_use`` and ``thinking`` (assistant) or ``tool_result`` (user)."""

    model_config = ConfigDict(extra="ignore")
    #: the schema lists the served types (``redacted_thinking`` is dropped); others (images,
    #: documents) get a 400 naming them
    type: Annotated[str, Field(json_schema_extra={"enum": ["text", "tool_use", "tool_result", *THINKING_BLOCKS]})]
    text: str | None = None
    #: a ``thinking`` block's reasoning
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None
    content: str | list | None = None
    is_error: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    #: ``system``: a mid-conversation system message (:mod:`quanta.server.system_turns`)
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class JsonOutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(BaseModel):
    """``output_config``: ``format`` is honoured, ``effort`` (and anything else) has no effect."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    effort: Any = None
    format: JsonOutputFormat | None = None


class Thinking(BaseModel):
    """``thinking``: accepted with no effect (a model reasons as its chat template has it)."""

    model_config = ConfigDict(extra="allow")
    type: str


class CountTokensRequest(FieldRule, NullMeansDefault):
    """``POST /v1/messages/count_tokens``."""

    DOCUMENTED = ANTHROPIC_MESSAGES
    RENAMED = {"max_completion_tokens": "max_tokens", "max_output_tokens": "max_tokens", "stop": "stop_sequences",
               "response_format": "output_config.format"}
    #: None (left out): the served model, as vLLM and llama-server default to it (:func:`quanta.server.defaults.served_model`)
    model: str | None = None
    messages: turns(Message)
    system: str | list[ContentBlock] | None = None
    tools: Annotated[list[AnthropicTool], FEW_TOOLS, unique_tools(lambda t: t.name)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    def ignored_parts(self) -> list[str]:
        parts = [] if self.thinking is None or self.thinking.type == "disabled" else [f"thinking ({self.thinking.type})"]
        if self.output_config is not None:
            parts += [f"output_config.{k}" for k in ("effort", *(self.output_config.model_extra or {}))
                      if getattr(self.output_config, k, None) is not None]
        parts += [f"messages.{i}.content.{j} ({b.type})" for i, m in enumerate(self.messages) if not isinstance(m.content, str)
                  for j, b in enumerate(m.content) if b.type == "redacted_thinking"]
        return parts + [f"tools.{i} ({t.type})" for i, t in enumerate(self.tools or []) if t.server_tool]

    def function_tools(self) -> list[AnthropicTool]:
        """The client's tools the model may call (server tools are never called)."""
        return [t for t in self.tools or [] if not t.server_tool]

    @property
    def use_tools(self) -> bool:
        return bool(self.function_tools()) and (self.tool_choice is None or self.tool_choice.type != "none")

    def chat_tools(self) -> list[dict] | None:
        """The tools the model may call, OpenAI-shaped (None when it may call none)."""
        return [t.openai() for t in self.function_tools()] if self.use_tools else None

    def forced_tools(self) -> list[dict] | None:
        """Tools a call must come from (``any``: all, ``tool``: the named one), else None.

        Raises:
            APIError: 400 for a choice without tools or naming an unknown tool.
        """
        choice = self.tool_choice
        if choice is None or choice.type in ("auto", "none"):
            return None
        if not self.function_tools():
            raise APIError(400, "tool_choice: requires tools (server tools are not run here)")
        tools = [t.openai() for t in self.function_tools() if choice.type == "any" or t.name == choice.name]
        if not tools:
            raise APIError(400, f"tool_choice: names {choice.name!r}, which is not among tools")
        return tools

    def format_schema(self) -> dict | None:
        """The JSON schema of ``output_config.format`` (None without one)."""
        fmt = self.output_config.format if self.output_config else None
        return fmt.schema_ if fmt is not None else None


class Metadata(BaseModel):
    """``metadata``: any fields; ``cache_salt`` there is taken when the top-level one is absent."""

    model_config = ConfigDict(extra="allow")
    cache_salt: CacheSalt | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages`` (ranges as Anthropic documents them)."""

    NO_EFFECT = frozenset({"service_tier"})
    max_tokens: integer(ge=1)
    stop_sequences: StopList | None = None
    stream: StrictFlag = False
    temperature: number(ge=0.0, le=1.0) = 1.0
    top_p: number(gt=0.0, le=1.0) | None = None
    top_k: integer(ge=0) | None = None
    cache_salt: CacheSalt | None = None
    metadata: Metadata | None = None
    service_tier: str | None = Field(None, description="accepted; no effect")
    container: only(None) = None

    @field_validator("stop_sequences")
    @classmethod
    def _bounded_stop(cls, stop):
        return stop if stop is None else check_stop_strings(stop, "stop_sequences")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p or 1.0,
            top_k=self.top_k or 0, stop=list(self.stop_sequences or []), cache_salt=self.salt(),
        )

    def salt(self) -> str | None:
        """The top-level ``cache_salt``, else ``metadata.cache_salt`` (None: unsalted)."""
        if self.cache_salt is not None or self.metadata is None:
            return self.cache_salt
        return self.metadata.cache_salt
