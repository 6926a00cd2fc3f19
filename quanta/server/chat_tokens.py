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
whole, as before (logged). Tool definitions and tool-call arguments are still
part of the template text.
"""

from __future__ import annotations

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
    masked = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and content:
            holder = f"quantamsg{nonce}n{i}e"
            contents[holder] = content
            message = {**message, "content": holder}
        masked.append(message)

    def render(msgs: list[dict]) -> str:
        return hf.apply_chat_template(msgs, tools=tools or None, tokenize=False, add_generation_prompt=True)

    parts = re.split(f"(quantamsg{nonce}n\\d+e)", render(masked))
    holders = parts[1::2]
    if sorted(holders) != sorted(contents) or "".join(contents.get(p, p) for p in parts) != render(messages):
        log.info("chat template does not reproduce message text verbatim; encoding the prompt whole")
        return tokenizer.apply_chat_template(messages, tools)
    ids: list[int] = []
    for k, part in enumerate(parts):
        if k % 2:
            ids += hf.encode(contents[part], add_special_tokens=False, split_special_tokens=True)
        elif part:
            ids += hf.encode(part, add_special_tokens=False)  # the template writes BOS etc. itself
    return ids
