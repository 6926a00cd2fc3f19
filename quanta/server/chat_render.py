"""The model's chat template rendered as transformers' ``apply_chat_template`` renders it.

:func:`render_chat` gives the prompt text of a conversation: the template is
picked as transformers picks it (a dict of named templates gives ``tool_use``
when tools are sent, else ``default``), messages lose their ``None``-valued
keys, the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) are
template variables, and the text is rendered by transformers' own
``render_jinja_template`` (its sandboxed Jinja environment with
``raise_exception``, ``strftime_now``, the ``tojson`` options and loop
controls; reasoning aliased as ``reasoning_content`` and ``thinking``). It
reads only the tokenizer's ``chat_template``, ``special_tokens_map`` and
``name_or_path`` attributes; nothing is tokenized.

A template that raises on the conversation gives :class:`TemplateRejected`,
whose message names the template (the tokenizer's ``name_or_path``, and the
variant when the model has several) and the first message it cannot take.
"""

from __future__ import annotations

import functools
from pathlib import Path

from quanta.model.tokenizer import Tokenizer


class TemplateRejected(ValueError):
    """The model's chat template raised on the conversation (the message says where)."""


def pick_template(chat_template: str | dict[str, str] | None, tools: list[dict] | None) -> tuple[str | None, str | None]:
    """``(template text, variant name)`` of ``chat_template`` for a request with ``tools``
    (``None`` tools: none sent); the name is None for a single template.

    Raises:
        ValueError: several named templates, none ``default`` (nor ``tool_use`` with tools).
    """
    if not isinstance(chat_template, dict):
        return chat_template or None, None
    for name in (("tool_use", "default") if tools is not None else ("default",)):
        if name in chat_template:
            return chat_template[name], name
    raise ValueError(f"this model has several chat templates and none named 'default' (names: {sorted(chat_template)})")


def request_template(tokenizer: Tokenizer, tools: list[dict] | None) -> str | None:
    """The template text a request with ``tools`` (None or empty: none) is rendered with."""
    return pick_template(tokenizer.hf.chat_template, tools or None)[0]


def template_label(tokenizer: Tokenizer, variant: str | None = None) -> str:
    """How errors name the model's template: ``chat template of <name>`` (``'tool_use' ...`` for a variant)."""
    name = Path(str(getattr(tokenizer.hf, "name_or_path", "") or "")).name
    label = f"chat template of {name}" if name else "the model's chat template"
    return f"{variant!r} {label}" if variant else label


def render_chat(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """Prompt text of ``messages`` and ``tools`` through the model's template, with the generation prompt.

    Raises:
        ValueError: the model ships no chat template (or no default among several).
        TemplateRejected: the template raised on the conversation.
    """
    hf = tokenizer.hf
    tools = tools or None
    template, variant = pick_template(hf.chat_template, tools)
    if not template:
        raise ValueError("this model has no chat template; use plain completions instead of chat")
    special = dict(hf.special_tokens_map)
    try:
        return _render(template, special, messages, tools)
    except Exception as exc:  # noqa: BLE001 - whatever the model's template raises
        where = _culprit(template, special, messages, tools)
        raise TemplateRejected(f"{template_label(tokenizer, variant)} cannot take {where}: {exc}") from exc


def _render(template: str, special: dict, messages: list[dict], tools: list[dict] | None) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template  # loaded by the tokenizer by then

    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    rendered, _ = render_jinja_template([chat], tools=tools, chat_template=template, add_generation_prompt=True, **special)
    return rendered[0]


def _culprit(template: str, special: dict, messages: list[dict], tools: list[dict] | None) -> str:
    """What the template cannot take: the tools (the conversation renders without them or with
    none), else the message after the longest prefix that renders (message 0 only when the rest
    renders without it)."""
    def renders(msgs: list[dict], tool_list: list[dict] | None) -> bool:
        try:
            _render(template, special, msgs, tool_list)
        except Exception:  # noqa: BLE001
            return False
        return True

    if not messages:
        return "an empty conversation"
    if tools is not None and (renders(messages, None) or renders(messages, [])):
        return "the tools it was given"
    ok = max((k for k in range(1, len(messages)) if renders(messages[:k], tools)), default=0)
    if ok == 0 and not (len(messages) > 1 and renders(messages[1:], tools)):
        return "any conversation (it raises on every one tried)"
    return f"message {ok} ({message_shape(messages[ok])})"


def takes_string_arguments(tokenizer: Tokenizer, template: str) -> bool:
    """Whether ``template`` raises on a call's arguments as an object but renders them as JSON
    text (Functionary v3.2's concatenates them to strings), as llama.cpp probes it."""
    return _takes_string_arguments(template, tuple(sorted(tokenizer.hf.special_tokens_map.items())))


@functools.lru_cache(maxsize=16)
def _takes_string_arguments(template: str, special: tuple) -> bool:
    def renders(arguments) -> bool:
        call = {"id": "call00001", "type": "function", "function": {"name": "f", "arguments": arguments}}
        chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            _render(template, dict(special), chat, None)
        except Exception:  # noqa: BLE001
            return False
        return True
    return not renders({"a": 1}) and renders('{"a": 1}')


def message_shape(message: dict) -> str:
    """A message's shape in words: its role and the parts beyond plain text (``assistant with tool_calls``)."""
    role = message.get("role")
    extras = [k for k in ("tool_calls", "reasoning_content", "tool_call_id") if message.get(k)]
    if isinstance(message.get("content"), list):
        extras.append("content parts")
    return f"role {role!r}" + (f" with {', '.join(extras)}" if extras else "")
