"""Tool use on Anthropic's Messages API: ``tools``, ``tool_choice``,
``tool_use`` / ``tool_result`` blocks, and tool_use in responses and streams.

Anthropic's shapes are mapped onto the OpenAI-shaped messages that
:func:`quanta.server.tool_formats.templates.render_for_template` renders, so both APIs reach
the model through the same chat template and parser. ``tool_choice``:
``auto`` (parse the output), ``none`` (tools left out of the prompt), ``any``
(some tool, enforced by a grammar) and ``{"type": "tool", "name"}`` (that
one); ``disable_parallel_tool_use`` limits a forced choice to one call.
Streamed tool_use blocks are built in :class:`quanta.server.anthropic.messages.ToolBlocks`.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quanta.server.field_rule import field_error
from quanta.server.tool_formats.calls import ToolCall

#: content blocks of a reasoning model's earlier turns: ``thinking`` is the assistant message's
#: ``reasoning_content`` (the chat template writes or drops it), ``redacted_thinking`` is dropped
THINKING_BLOCKS = ("thinking", "redacted_thinking")


class AnthropicTool(BaseModel):
    """A client tool (``type`` absent or ``custom``: needs ``input_schema``), or a server tool
    (any other ``type``, e.g. ``web_search_20250305``): accepted, never called, since quanta runs no tools."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict | None = None
    type: str | None = None

    @property
    def server_tool(self) -> bool:
        return self.type not in (None, "custom")

    @model_validator(mode="after")
    def _schema_given(self):
        if not self.server_tool and self.input_schema is None:
            raise field_error("input_schema", "Field required (a client tool needs an input_schema)")
        return self

    def openai(self) -> dict:
        fn = {"name": self.name, "parameters": self.input_schema}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


def tool_use_id(call_id: str) -> str:
    """Anthropic-style id (``toolu_...``) of a parsed call's id (``call_...``)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_use_block(call: ToolCall) -> dict:
    """The ``tool_use`` content block of a finished call (``input``: its arguments decoded)."""
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": json.loads(call.arguments)}


def thinking_block(text: str) -> dict:
    """The ``thinking`` content block of the model's reasoning (no signature: nothing is signed here)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def _result_text(content, where: str, error) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise error(400, f"{where}.{j}: tool_result content of type {kind!r} is not supported (text only)")
        parts.append(block["text"])
    return "".join(parts)


def chat_messages(messages, error) -> list[dict]:
    """Anthropic ``messages`` as OpenAI-shaped chat messages.

    ``tool_result`` blocks become ``role: tool`` messages (before the user
    text of the same turn), ``tool_use`` blocks the assistant's ``tool_calls``,
    ``thinking`` blocks its ``reasoning_content`` (several joined by a newline,
    as OpenAI's messages carry it); ``redacted_thinking`` blocks are dropped.

    Args:
        error: the exception class raised as ``error(400, message)`` for
            blocks that are not text, tool_use or tool_result.
    """
    out: list[dict] = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results, thoughts = [], [], [], []
        for j, block in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if block.type == "text" and block.text is not None:
                texts.append(block.text)
            elif block.type == "tool_use" and m.role == "assistant":
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input or {}, ensure_ascii=False)}})
            elif block.type in THINKING_BLOCKS and m.role == "assistant":
                if block.type == "thinking" and block.thinking:
                    thoughts.append(block.thinking)
            elif block.type == "tool_result" and m.role == "user":
                text = _result_text(block.content, f"{where}.content", error)
                results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": ("Error: " + text) if block.is_error else text})
            else:
                raise error(400, f"{where}: content blocks of type {block.type!r} are not supported here "
                                 "(text, tool_use in assistant turns, tool_result in user turns)")
        out += results
        if texts or calls or not results:
            msg = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thoughts:
                msg["reasoning_content"] = "\n".join(thoughts)
            out.append(msg)
    return out
