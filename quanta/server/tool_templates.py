"""Tools on the way in: what the chat template gets for a request with tools.

A template that reads the ``tools`` variable (:func:`template_reads_tools`;
Qwen's, Hermes') gets the tools and the conversation's calls in Hugging Face's
shape. One that does not (SmolLM2's) gets the tools in a Hermes-style system
prompt, as Qwen 2.5's template writes it, and earlier calls and results as
Hermes text (:func:`render_for_template`), so the model answers in the format
:class:`quanta.server.tools.HermesParser` reads.
"""

from __future__ import annotations

import json

import jinja2
import jinja2.meta

from quanta.server.tools import parse_json


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


def render_for_template(messages: list[dict], tools: list[dict] | None, native: bool) -> tuple[list[dict], list[dict] | None]:
    """``(messages, tools)`` to hand the chat template.

    ``messages`` are OpenAI-shaped dicts (``tool_calls`` with JSON-text
    arguments, ``role: tool`` with ``tool_call_id``). A ``native`` template
    (one that reads ``tools``) gets them as Hugging Face templates expect:
    arguments as objects. Otherwise tools go into the system prompt, calls
    into the assistant text as Hermes blocks, and tool results into a user
    turn of ``<tool_response>`` blocks (consecutive results merged).
    """
    if native:
        return [_native_message(m) for m in messages], tools
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
            out.append({"role": "assistant", "content": "\n".join(([m["content"]] if m.get("content") else []) + blocks)})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out], None


def _native_message(m: dict) -> dict:
    if m["role"] == "assistant" and m.get("tool_calls"):
        calls = [{"id": c.get("id"), "type": "function",
                  "function": {"name": c["function"]["name"], "arguments": parse_json(c["function"]["arguments"] or "{}") or {}}}
                 for c in m["tool_calls"]]
        return {"role": "assistant", "content": m.get("content") or "", "tool_calls": calls}
    return {k: v for k, v in m.items() if v is not None}
