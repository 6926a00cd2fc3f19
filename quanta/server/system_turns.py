"""System messages after the first turn (a mid-conversation ``system`` message,
as Claude Code sends on Anthropic's Messages API): rendered as a system turn
where the model's chat template allows it, else folded into the system prompt.

A template allows it when it renders the conversation without raising (many
refuse with "system message must be at the beginning") and writes each later
system message's text (some drop it silently). Otherwise the later system
texts are appended, in order, to the leading system message (one is created
when there is none), separated by blank lines. A conversation whose only
system message comes first is left as it is, and no template is probed.
"""

from __future__ import annotations

import uuid

from quanta.model.tokenizer import Tokenizer
from quanta.server.chat_render import render_chat
from quanta.server.chat_tokens import chat_prompt_ids


def later_system(messages: list[dict]) -> list[int]:
    """Indices of ``system`` messages after the first message."""
    return [i for i, m in enumerate(messages) if i > 0 and m.get("role") == "system"]


def _template_writes(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None, later: list[int]) -> bool:
    """Whether the template renders ``messages`` with each later system message's text in place."""
    nonce = uuid.uuid4().hex
    probe = [{**m, "content": f"quantasys{nonce}n{i}e"} if i in later else m for i, m in enumerate(messages)]
    try:
        text = render_chat(tokenizer, probe, tools)
    except ValueError:  # a template that refuses the turn: fold it (no template: chat_prompt_ids says so)
        return False
    return all(f"quantasys{nonce}n{i}e" in text for i in later)


def fold_system(messages: list[dict], later: list[int]) -> list[dict]:
    """``messages`` with the ``later`` system messages' texts appended to the leading system message."""
    lead = messages[0] if messages[0].get("role") == "system" else None
    texts = ([lead.get("content") or ""] if lead else []) + [messages[i].get("content") or "" for i in later]
    rest = [m for i, m in enumerate(messages) if i not in later and m is not lead]
    return [{**(lead or {"role": "system"}), "content": "\n\n".join(t for t in texts if t)}] + rest


def place_system_turns(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` as the template will get them (see the module docstring)."""
    later = later_system(messages)
    if not later or _template_writes(tokenizer, messages, tools, later):
        return messages
    return fold_system(messages, later)


def prompt_ids(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """:func:`quanta.server.chat_tokens.chat_prompt_ids` of ``messages`` with their system turns placed."""
    return chat_prompt_ids(tokenizer, place_system_turns(tokenizer, messages, tools), tools)


def prompt_text(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """The prompt text :func:`prompt_ids` encodes (the template's rendering, system turns placed)."""
    return render_chat(tokenizer, place_system_turns(tokenizer, messages, tools), tools)
