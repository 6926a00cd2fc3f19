"""Tools on the way in: what the chat template gets for a request
(:func:`template_input`).

The template is the one the request is rendered with
(:func:`quanta.server.chat_render.request_template`: a model's ``tool_use``
variant when tools are sent). A template that reads the ``tools`` variable
(:func:`template_reads_tools`; Qwen's, Llama 3.1's, Hermes') gets the tools
and the conversation in Hugging Face's shape (calls' arguments as objects),
so the prompt is exactly what transformers' ``apply_chat_template`` renders.
So does any template when the request sends no tools and the conversation
has no calls or results it ignores.

A template that does not read ``tools`` (SmolLM2's, Phi-3.5's, gemma-2's)
cannot tell the model about them. When a request sends tools to such a
template, or earlier calls or tool results that it does not read (it never
mentions ``tool_calls``), quanta writes them in as Qwen 2.5's template does
(:func:`render_for_template`): the tools in a Hermes-style system prompt,
calls as ``<tool_call>`` blocks in the assistant text and results as a user
turn of ``<tool_response>`` blocks, so the model answers in the format
:class:`quanta.server.tool_formats.base.HermesParser` reads. Such a prompt is not
transformers' (which would drop the tools); it is transformers' rendering of
the rewritten conversation.
"""

from __future__ import annotations

import json

import jinja2
import jinja2.meta

from quanta.model.tokenizer import Tokenizer
from quanta.server.chat_render import request_template, takes_string_arguments
from quanta.server.tool_formats.calls import parse_json


def template_input(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """``(messages, tools)`` to render OpenAI-shaped ``messages`` and ``tools`` with (see the module docstring)."""
    try:
        template = request_template(tokenizer, tools)
    except ValueError:
        template = None  # no usable template: rendering refuses it with its own message
    if needs_hermes_text(template, messages, tools):
        return render_for_template(messages, tools, False)
    return render_for_template(messages, tools, True, string_arguments=bool(template) and takes_string_arguments(tokenizer, template))


def needs_hermes_text(template: str | None, messages: list[dict], tools: list[dict] | None) -> bool:
    """Whether ``template`` gets the tools and calls as Hermes text: it does not read ``tools``
    and the request sends tools, or calls or tool results that it never reads."""
    if template is None or template_reads_tools(template):
        return False
    history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    return bool(tools) or (history and "tool_calls" not in template)


def template_reads_tools(template: str | None) -> bool:
    """Whether the Jinja ``template`` uses the ``tools`` variable."""
    if not template:
        return False
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return "tools" in template


#: The tool prompt of Qwen 2.5's chat template, for templates without one.
_FALLBACK_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def render_for_template(messages: list[dict], tools: list[dict] | None, native: bool,
                        string_arguments: bool = False) -> tuple[list[dict], list[dict] | None]:
    """``(messages, tools)`` to hand the chat template.

    ``messages`` are OpenAI-shaped dicts (``tool_calls`` with JSON-text
    arguments, ``role: tool`` with ``tool_call_id``). A ``native`` template
    (one that reads ``tools``) gets them as Hugging Face templates expect:
    arguments as objects (as the JSON text sent with ``string_arguments``, for a
    template that only takes that). Otherwise tools go into the system prompt, calls
    into the assistant text as Hermes blocks, and tool results into a user
    turn of ``<tool_response>`` blocks (consecutive results merged).
    """
    if native:
        return [_native_message(m, string_arguments) for m in messages], tools
    out: list[dict] = []
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = _FALLBACK_PROMPT.format(tools=listing)
        if messages and messages[0]["role"] in ("system", "developer"):
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + prompt})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": prompt})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [f'<tool_call>\n{{"name": {json.dumps(c["function"]["name"])}, '
                      f'"arguments": {c["function"]["arguments"] or "{}"}}}\n</tool_call>'
                      for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            out.append({**{k: v for k, v in m.items() if k != "tool_calls"}, "content": text})
        else:
            out.append({**m, "content": m.get("content") or ""})
    return [{k: v for k, v in m.items() if k != "_tool_results" and v is not None} for m in out], None


def _native_message(m: dict, string_arguments: bool) -> dict:
    """``m`` in Hugging Face's shape: no None values and a call's arguments as an object.
    An assistant call's ``null`` content is an empty string, as vLLM gives it (Qwen3's,
    QwQ's and Granite 3.3's templates raise on a call without ``content``)."""
    out = {k: v for k, v in m.items() if v is not None}
    if m["role"] == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = [_native_call(c, string_arguments) for c in m["tool_calls"]]
        out["content"] = m.get("content") or ""
    return out


def _native_call(call: dict, string_arguments: bool) -> dict:
    fn = call["function"]
    arguments = fn.get("arguments") or "{}"
    native = {"id": call.get("id"), "type": "function",
              "function": {"name": fn["name"], "arguments": arguments if string_arguments else parse_json(arguments) or {}}}
    return {k: v for k, v in native.items() if v is not None}
