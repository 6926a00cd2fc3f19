"""The prompt token ids a request's body will have on a replica, for routing.

The front of a cluster routes by prompt prefix, so it needs the ids the
replica will compute: the same request models (:mod:`quanta.server.protocol`'s
OpenAI bodies, :mod:`quanta.server.anthropic.requests`,
:mod:`quanta.server.responses.requests`) and the same renderers
(:func:`quanta.server.openai.chat.chat_prompt`, :func:`quanta.server.anthropic.messages.render_prompt`,
:meth:`quanta.server.limits.PromptWork.encode`) over the same tokenizer and
chat template. A body those refuse has no ids (None): it goes to any
replica, whose own route answers it with the single server's 400.
"""

from __future__ import annotations

import json

from quanta.model.tokenizer import Tokenizer
from quanta.server.anthropic.messages import render_prompt
from quanta.server.anthropic.requests import MessagesRequest
from quanta.server.limits import PromptWork
from quanta.server.openai.chat import chat_prompt
from quanta.server.openai.requests import ChatRequest, CompletionsRequest
from quanta.server.responses.requests import ResponsesRequest


class RoutingPrompts:
    """Renders generation bodies to prompt ids as the replicas' routes do
    (it has the two attributes those renderers read of the server state)."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.prompts = PromptWork(tokenizer, max_model_len)

    async def tokens(self, path: str, body: bytes) -> list[int] | None:
        """Prompt ids of a generation request to ``path``; None for another path or a body the route refuses."""
        render = _RENDERERS.get(path)
        if render is None:
            return None
        try:
            return await render(self, json.loads(body))
        except Exception:  # the replica answers it (a 400 naming the field); routing needs no ids then
            return None


async def _chat(state: RoutingPrompts, data: dict) -> list[int]:
    body = ChatRequest.model_validate(data)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.use_tools else None
    return await chat_prompt(state, [m.as_dict() for m in body.messages], tools)


async def _completion(state: RoutingPrompts, data: dict) -> list[int]:
    body = CompletionsRequest.model_validate(data)
    return body.prompt if isinstance(body.prompt, list) else await state.prompts.encode(body.prompt, "prompt")


async def _responses(state: RoutingPrompts, data: dict) -> list[int]:
    body = ResponsesRequest.model_validate(data)
    tools = body.chat_tools() if body.tool_choice != "none" else []
    return await chat_prompt(state, body.messages(), tools or None)


async def _messages(state: RoutingPrompts, data: dict) -> list[int]:
    return await render_prompt(state, MessagesRequest.model_validate(data))


_RENDERERS = {"/v1/chat/completions": _chat, "/v1/completions": _completion, "/v1/responses": _responses,
              "/v1/messages": _messages}
