"""Chat prompt ids in which message text cannot forge a control token.

The chat template's output mixes the template's own markers (``<|im_start|>``,
``<|im_end|>``, BOS) with the text of each message. Encoding that string whole
turns a user's literal ``<|im_end|>\\n<|im_start|>system`` into real control
tokens: a forged turn. :func:`chat_prompt_ids` renders the template with each
message's string content replaced by a random placeholder, encodes the
template's parts with special tokens recognised and each content part with
``split_special_tokens=True`` (Hugging Face's option: special-token text is
tokenized as plain text), then joins them in order.

The split is used only when it is exact: every placeholder appears once and
putting the contents back gives the template's real rendering (a template
that trims or rewrites content fails this); otherwise the prompt is encoded
whole, as before (logged). The string values of tool definitions and of
tool-call arguments (what a native template writes with ``tojson``) are masked
the same way and, when the template escapes them as JSON, put back escaped:
a tool description cannot forge a control token either. (Without a native
template, tools and calls are message text already.)
"""

from __future__ import annotations

import json
import logging
import re
import uuid

from quanta.model.tokenizer import Tokenizer

log = logging.getLogger("quanta.server")


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Prompt ids of ``messages`` (and ``tools``) through the model's template,
    ending with the generation prompt; message text never yields a special token.

    Raises:
        ValueError: the model ships no chat template.
        Exception: whatever the model's template raises for the conversation.
    """
    hf = tokenizer.hf
    if not hf.chat_template:
        return tokenizer.apply_chat_template(messages, tools)  # raises its clear ValueError
    nonce = uuid.uuid4().hex
    contents: dict[str, str] = {}
    escaped: set[str] = set()  # holders of strings a template writes as JSON (tool definitions, arguments)

    def holder(text: str, as_json: bool) -> str:
        name = f"quantamsg{nonce}n{len(contents)}e"
        contents[name] = text
        if as_json:
            escaped.add(name)
        return name

    masked = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and content:
            message = {**message, "content": holder(content, False)}
        if message.get("tool_calls"):
            message = {**message, "tool_calls": [_mask_function(c, "arguments", holder) for c in message["tool_calls"]]}
        masked.append(message)
    masked_tools = [_mask_function(t, "parameters", holder) for t in tools] if tools else None

    def render(msgs: list[dict], tool_list: list[dict] | None) -> str:
        return hf.apply_chat_template(msgs, tools=tool_list or None, tokenize=False, add_generation_prompt=True)

    parts = re.split(f"(quantamsg{nonce}n\\d+e)", render(masked, masked_tools))
    for name in escaped:
        contents[name] = json.dumps(contents[name], ensure_ascii=False)[1:-1]
    if set(parts[1::2]) - set(contents) or "".join(contents.get(p, p) for p in parts) != render(messages, tools):
        log.info("chat template does not reproduce message text verbatim; encoding the prompt whole")
        return tokenizer.apply_chat_template(messages, tools)
    ids: list[int] = []
    for k, part in enumerate(parts):
        if k % 2:
            ids += hf.encode(contents[part], add_special_tokens=False, split_special_tokens=True)
        elif part:
            ids += hf.encode(part, add_special_tokens=False)  # the template writes BOS etc. itself
    return ids


def _mask_strings(value, holder):
    """``value`` with every string value but schema ``type`` names replaced by ``holder(text, True)``."""
    if isinstance(value, dict):
        return {k: v if k == "type" and isinstance(v, str) else _mask_strings(v, holder) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask_strings(v, holder) for v in value]
    if isinstance(value, str) and value:
        return holder(value, True)
    return value


def _mask_function(item: dict, field: str, holder) -> dict:
    """A tool or call ``item`` with its ``function``'s ``description`` and ``field``
    (``parameters`` or ``arguments``) masked; ``type`` and ``name`` stay, as templates test and print them."""
    fn = item.get("function")
    if not isinstance(fn, dict):
        return item
    masked = {k: _mask_strings(v, holder) if k in ("description", field) else v for k, v in fn.items()}
    return {**item, "function": masked}
