"""Chat prompt ids in which no client text can forge a control token.

The chat template's output mixes the template's own markers (``<|im_start|>``,
``<|im_end|>``, BOS) with the client's strings. Encoding that string whole
turns a user's literal ``<|im_end|>\\n<|im_start|>system`` into real control
tokens: a forged turn. :func:`chat_prompt_ids` renders the template with the
client's strings replaced by random placeholders, encodes the template's parts
with special tokens recognised and each client string with special-token
text tokenized as plain text (:meth:`Tokenizer.encode_text`, which changes
no shared tokenizer setting, so concurrent requests cannot mix the two
modes), then joins them in order.

Which strings are replaced:

* free text, always: message ``content`` and ``reasoning_content``, tool
  ``description``, and every
  string value inside a tool's ``parameters`` or a call's ``arguments``;
* every other string the client sent (JSON keys of parameters and arguments,
  ``type`` names inside a schema, tool and call names, call ids,
  ``tool_call_id``, a message's ``name``) when it contains the text of one of
  the tokenizer's added tokens; the rest stay as they are, so a template that
  tests ``type == "object"`` or reads ``parameters.properties`` still sees them.

Strings of tool definitions and call arguments (which a native template
writes with ``tojson``) are put back JSON-escaped. The split is used only
when it is exact: every placeholder appears once and putting the strings back
gives the template's real rendering (a template that trims or rewrites
content fails this). Otherwise the prompt is encoded whole, which is safe
only when it holds no more control tokens than the template wrote itself;
if the client's text added any, the request is refused
(:class:`ForgedControlToken`).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import uuid
from collections import Counter

from quanta.model.tokenizer import Tokenizer
from quanta.server.chat_render import render_chat

log = logging.getLogger("quanta.server")


class ForgedControlToken(ValueError):
    """Client text would become a control token and the template gives no exact way to keep it text."""


def text_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of client ``text`` with special-token text spelled out as plain text (no BOS)."""
    return tokenizer.encode_text(text)


@functools.lru_cache(maxsize=4)
def control_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special tokens (the ones a template's markers use).

    Cached per tokenizer (which never changes): transformers rebuilds
    ``added_tokens_decoder`` on each read (~0.15 s with Llama 3's 256 added tokens).
    """
    hf = tokenizer.hf
    return frozenset(hf.all_special_ids) | {i for i, t in hf.added_tokens_decoder.items() if t.special}


@functools.lru_cache(maxsize=4)
def added_token_pattern(tokenizer: Tokenizer) -> re.Pattern | None:
    """One regex matching any added token's text, longest first (None without added tokens).

    Cached per tokenizer: with tens of thousands of added tokens (a padded
    vocabulary) building and compiling it takes seconds.
    """
    texts = sorted({t.content for t in tokenizer.hf.added_tokens_decoder.values() if t.content},
                   key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Prompt ids of ``messages`` (and ``tools``) through the model's template
    (:func:`quanta.server.chat_render.render_chat`), ending with the generation
    prompt; no client string yields a control token.

    Raises:
        ValueError: the model ships no chat template.
        TemplateRejected: the template raised on the conversation.
        ForgedControlToken: the template rewrites the client's text (so it cannot
            be split out) and that text holds control-token text.
    """
    real = render_chat(tokenizer, messages, tools)
    masker = _Masker(added_token_pattern(tokenizer))
    masked = [masker.message(m) for m in messages]
    masked_tools = [masker.function(t, "parameters", True) for t in tools] if tools else None
    try:
        template_text = render_chat(tokenizer, masked, masked_tools)
    except ValueError:  # the template reads the client's text (placeholders broke it)
        return _unsplit(tokenizer, real, masker)
    parts = re.split(f"({masker.prefix}\\d+e)", template_text)
    contents = masker.restored()
    if set(parts[1::2]) - set(contents) or "".join(contents.get(p, p) for p in parts) != real:
        return _whole(tokenizer, real, template_text)
    ids: list[int] = []
    for k, part in enumerate(parts):
        if k % 2:
            ids += text_ids(tokenizer, contents[part])
        elif part:
            ids += tokenizer.encode(part, add_special_tokens=False)  # the template writes BOS etc. itself
    return ids


def _unsplit(tokenizer: Tokenizer, real: str, masker: _Masker) -> list[int]:
    """``real`` encoded whole where the template cannot render placeholders: refused
    if any client string holds an added token's text."""
    if masker.holds_added_text():
        raise ForgedControlToken(
            "the conversation's text contains control-token text and this model's chat template "
            "reads the text itself, so it cannot be kept as plain text; remove it")
    return tokenizer.encode(real, add_special_tokens=False)


def _whole(tokenizer: Tokenizer, real: str, template_text: str) -> list[int]:
    """``real`` encoded whole, unless it holds control tokens that ``template_text``
    (the rendering with placeholders) does not: those came from the client."""
    log.info("chat template does not reproduce message text verbatim; encoding the prompt whole")
    control = control_token_ids(tokenizer)
    ids = tokenizer.encode(real, add_special_tokens=False)
    template_only = Counter(i for i in tokenizer.encode(template_text, add_special_tokens=False) if i in control)
    forged = Counter(i for i in ids if i in control) - template_only
    if forged:
        names = ", ".join(sorted(tokenizer.hf.convert_ids_to_tokens(list(forged))))
        raise ForgedControlToken(
            f"the conversation's text contains control-token text ({names}) and this model's chat template "
            "does not reproduce the text verbatim, so it cannot be kept as plain text; remove it")
    return ids


class _Masker:
    """Replaces client strings by placeholders ``quantamsg<nonce>n<k>e`` (see the module docstring)."""

    def __init__(self, added: re.Pattern | None) -> None:
        self.prefix = f"quantamsg{uuid.uuid4().hex}n"
        self.contents: dict[str, str] = {}
        self.escaped: set[str] = set()  # placeholders of strings a template writes as JSON
        self._added = added  # any added token's text (see added_token_pattern)

    def holder(self, text: str, as_json: bool) -> str:
        name = f"{self.prefix}{len(self.contents)}e"
        self.contents[name] = text
        if as_json:
            self.escaped.add(name)
        return name

    def holds_added_text(self) -> bool:
        """Whether any replaced client string holds an added token's text."""
        return self._added is not None and any(self._added.search(t) for t in self.contents.values())

    def restored(self) -> dict[str, str]:
        """Placeholder -> the text it stands for in the rendering (JSON-escaped where written as JSON)."""
        return {name: json.dumps(text, ensure_ascii=False)[1:-1] if name in self.escaped else text
                for name, text in self.contents.items()}

    def text(self, value, as_json: bool):
        """Free text: a non-empty string is always replaced."""
        if isinstance(value, str) and value:
            return self.holder(value, as_json)
        return self.other(value, as_json)

    def other(self, value, as_json: bool):
        """Any other client value: strings (keys included) replaced where they hold an added token's text."""
        if isinstance(value, str):
            return self.holder(value, as_json) if self._added is not None and self._added.search(value) else value
        if isinstance(value, dict):
            return {self.other(k, as_json): self.other(v, as_json) for k, v in value.items()}
        if isinstance(value, list):
            return [self.other(v, as_json) for v in value]
        return value

    def json_value(self, value):
        """``parameters`` / ``arguments``: string values always, keys and schema ``type`` names as :meth:`other`."""
        if isinstance(value, dict):
            return {self.other(k, True): self.other(v, True) if k == "type" else self.json_value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.json_value(v) for v in value]
        return self.text(value, True)

    def function(self, item: dict, field: str, as_json: bool) -> dict:
        """A tool (``field="parameters"``) or a call (``"arguments"``): its ``function``'s
        ``description`` and ``field`` masked as free text, the rest as :meth:`other`."""
        out = {k: self.other(v, as_json) for k, v in item.items() if k != "function"}
        fn = item.get("function")
        if isinstance(fn, dict):
            out["function"] = {k: self.text(v, True) if k == "description" else self.json_value(v) if k == field
                               else self.other(v, as_json) for k, v in fn.items()}
        elif "function" in item:
            out["function"] = self.other(fn, as_json)
        return out

    def message(self, message: dict) -> dict:
        out = {}
        for key, value in message.items():
            if key == "role":
                out[key] = value
            elif key in ("content", "reasoning_content"):
                out[key] = self.text(value, False) if isinstance(value, str) else self.other(value, False)
            elif key == "tool_calls" and isinstance(value, list):
                out[key] = [self.function(c, "arguments", False) if isinstance(c, dict) else self.other(c, False) for c in value]
            else:
                out[key] = self.other(value, False)
        return out
