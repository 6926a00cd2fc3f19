"""Ollama's request bodies (``/api/chat``, ``/api/generate``, ``/api/show``), validated by pydantic.

Every field Ollama documents is honoured, accepted with no effect (named in
the server log, :mod:`quanta.server.field_rule`), or refused with a 400 naming
it where ignoring it would answer another question: ``images`` (the served
models read text only), ``suffix`` (fill-in-the-middle), a custom
``template`` (Ollama's Go templates; the model's own chat template is used)
and the image-generation fields. ``options`` are :mod:`quanta.server.ollama.options`.
``null`` means the default, as in Ollama (Go's zero values).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from quanta.server.field_rule import FieldRule, field_error
from quanta.server.ollama.options import Options
from quanta.server.openai.requests import FEW_TOOLS, Tool, schema_problem, unique_tools
from quanta.server.protocol import NullMeansDefault, StrictFlag, UnicodeText, _fitting_turns, integer

#: top-level fields of Ollama's ``/api/chat`` (API docs and the official clients)
OLLAMA_CHAT = frozenset({"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think",
                         "logprobs", "top_logprobs", "truncate", "shift"})
#: top-level fields of Ollama's ``/api/generate``
OLLAMA_GENERATE = frozenset({"model", "prompt", "suffix", "images", "format", "options", "system", "template", "stream",
                             "raw", "keep_alive", "context", "think", "logprobs", "top_logprobs", "truncate", "shift",
                             "width", "height", "steps"})
#: fields that change nothing here: the model stays loaded, prompts are never truncated or shifted
NO_EFFECT = frozenset({"keep_alive"})

#: ``think``: on/off, or a reasoning level (gpt-oss)
Think = StrictFlag | Literal["low", "medium", "high"]


def _no_images(images):
    if images:
        raise ValueError("images are not supported: the served model reads text only")
    return images


def _format(value):
    """``format``: ``""`` (none), ``"json"`` or a JSON schema object that compiles."""
    if value is None or value in ("", "json"):
        return value
    if not isinstance(value, dict):
        raise ValueError('must be "json" or a JSON schema object')
    problem = schema_problem(value)
    if problem:
        raise ValueError(f"not a usable JSON schema: {problem}")
    return value


Images = Annotated[list[str] | None, BeforeValidator(_no_images)]
Format = Annotated[Any, BeforeValidator(_format), Field(json_schema_extra={"anyOf": [{"enum": ["", "json"]}, {"type": "object"}]})]


class CallFunction(BaseModel):
    name: str
    arguments: dict = Field(default_factory=dict)
    index: int | None = None


class CallIn(BaseModel):
    """An earlier assistant turn's call (``arguments`` an object, as Ollama sends it)."""

    id: str | None = None
    function: CallFunction


class Message(NullMeansDefault):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: UnicodeText = ""
    thinking: UnicodeText | None = None
    images: Images = None
    tool_calls: list[CallIn] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


def openai_messages(messages: list[Message]) -> list[dict]:
    """``messages`` in the OpenAI shape the chat template path takes: calls' arguments as JSON text,
    a tool result's ``tool_call_id`` its own, else that of the open call of its ``tool_name``, else the next open call."""
    out, open_calls = [], []
    for m in messages:
        item: dict = {"role": m.role, "content": m.content}
        if m.role == "assistant":
            calls = [{"id": c.id or f"call_{len(out)}_{k}", "type": "function",
                      "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments, ensure_ascii=False)}}
                     for k, c in enumerate(m.tool_calls or ())]
            open_calls = [(c["id"], c["function"]["name"]) for c in calls]
            if calls:
                item["tool_calls"] = calls
            if m.thinking:
                item["reasoning_content"] = m.thinking
        elif m.role == "tool":
            answered = m.tool_call_id or _answered(open_calls, m.tool_name)
            if answered:
                item["tool_call_id"] = answered
            if m.tool_name:
                item["name"] = m.tool_name
        out.append(item)
    return out


def _answered(open_calls: list[tuple[str, str]], name: str | None) -> str | None:
    """The id of the open call a tool result answers (by name when it names one), taken off the list."""
    k = next((i for i, (_, n) in enumerate(open_calls) if n == name), 0 if open_calls else None)
    return open_calls.pop(k)[0] if k is not None else None


class _Generation(FieldRule, NullMeansDefault):
    """Fields both generation routes share."""

    NO_EFFECT = NO_EFFECT

    model: Annotated[str, Field(min_length=1)]
    format: Format = None
    options: Options = Field(default_factory=Options)
    stream: StrictFlag = True
    keep_alive: str | int | float | None = None
    think: Think | None = None
    logprobs: StrictFlag = False
    top_logprobs: integer(ge=0, le=20) | None = None

    def format_schema(self) -> dict | None:
        """``format`` as a JSON schema (``"json"``: any object), None for none."""
        if self.format == "json":
            return {"type": "object"}
        return self.format if isinstance(self.format, dict) else None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def ignored_parts(self) -> list[str]:
        return self.options.ignored_names()


class ChatBody(_Generation):
    """``POST /api/chat``."""

    DOCUMENTED = OLLAMA_CHAT

    messages: Annotated[list[Message], BeforeValidator(_fitting_turns)] = Field(default_factory=list)
    tools: Annotated[list[Tool], FEW_TOOLS, unique_tools(lambda t: t.function.name)] | None = None

    @model_validator(mode="after")
    def _tool_choice(self):
        choice, names = self.options.tool_choice, [t.function.name for t in self.tools or ()]
        if choice in (None, "auto", "none"):
            return self
        if not names:
            raise field_error("options.tool_choice", "a forced call needs tools")
        if choice != "required" and choice not in names:
            raise field_error("options.tool_choice", f"{choice!r} is not among the tools' names "
                              "(auto, none, required or a tool's name)")
        if self.format:
            raise field_error("format", "give one constraint, a forced call (options.tool_choice) or format, not both")
        return self

    @property
    def use_tools(self) -> bool:
        """Tools reach the prompt and the output is parsed for calls."""
        return bool(self.tools) and self.options.tool_choice != "none"

    def forced_tools(self) -> list[dict] | None:
        """The tools a call must be made from (``options.tool_choice``, quanta's extension), else None."""
        choice = self.options.tool_choice
        if choice in (None, "auto", "none"):
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or () if choice == "required" or t.function.name == choice]


def _refused(message: str):
    def check(value):
        if value not in (None, "", [], 0, False):
            raise ValueError(message)
        return value
    return Annotated[Any, BeforeValidator(check), Field(None, description=message)]


class GenerateBody(_Generation):
    """``POST /api/generate``."""

    DOCUMENTED = OLLAMA_GENERATE

    prompt: UnicodeText = ""
    system: UnicodeText | None = None
    raw: StrictFlag = False
    context: list[Annotated[int, Field(strict=True)]] | None = None
    images: Images = None
    suffix: _refused("suffix (fill-in-the-middle) is not supported") = None
    template: _refused("a custom template is not supported: the model's own chat template renders the prompt") = None
    width: _refused("image generation is not supported") = None
    height: _refused("image generation is not supported") = None
    steps: _refused("image generation is not supported") = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.options.tool_choice is not None:
            raise field_error("options.tool_choice", "/api/generate takes no tools; use /api/chat")
        if self.system and self.raw:
            raise field_error("system", "not used with raw: true (the prompt is sent as it is); put it in the prompt")
        return self


class ShowBody(FieldRule, NullMeansDefault):
    """``POST /api/show``: ``model`` (``name``, Ollama's older spelling, also accepted)."""

    DOCUMENTED = frozenset({"model", "name", "verbose", "system", "template", "options"})

    model: str | None = None
    name: str | None = None
    verbose: StrictFlag = False

    @property
    def wanted(self) -> str | None:
        return self.model or self.name
