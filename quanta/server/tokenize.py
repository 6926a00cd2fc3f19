"""``POST /tokenize`` and ``POST /detokenize`` in the shapes vLLM and llama-server serve.

``/tokenize`` takes one of ``prompt`` (vLLM's completions shape), ``content``
(llama-server's) or ``messages`` (vLLM's chat shape, with optional ``tools``)
and answers with the ids the generation routes would compute for it: ``prompt``
and ``content`` as ``/v1/completions`` encodes its prompt, ``messages`` through
the chat template as ``/v1/chat/completions`` renders them. The body is
``{"count", "max_model_len", "tokens", "token_strs"}`` (vLLM's; llama-server's
clients read ``tokens``); ``token_strs`` holds the tokens' strings with
``return_token_strs: true`` (else null). ``/detokenize`` takes ``tokens`` and
answers ``{"prompt": TEXT}`` (vLLM) with the same text under ``content``
(llama-server). ``model`` is optional (:func:`quanta.server.defaults.served_model`).
Options of either server that change nothing here are accepted and logged.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from fastapi import APIRouter, Request
from pydantic import StrictBool, StrictInt, model_validator

from quanta.server.defaults import served_model
from quanta.server.errors import APIError
from quanta.server.field_rule import FieldRule, field_error, log_fields
from quanta.server.limits import PromptError
from quanta.server.openai.chat import chat_prompt
from quanta.server.openai.requests import FEW_TOOLS, Message, Tool
from quanta.server.protocol import turns
from quanta.server.serving import ServerState, check_model

#: options of vLLM's and llama-server's tokenizer routes that change nothing here
_NO_EFFECT = frozenset({"add_generation_prompt", "continue_final_message", "chat_template",
                        "chat_template_kwargs", "mm_processor_kwargs", "with_pieces", "parse_special"})


class TokenizeRequest(FieldRule):
    """``POST /tokenize``: one of ``prompt``, ``content`` or ``messages``."""

    DOCUMENTED: ClassVar[frozenset[str]] = _NO_EFFECT
    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: turns(Message) | None = None
    tools: Annotated[list[Tool], FEW_TOOLS] | None = None
    return_token_strs: StrictBool = False
    add_special_tokens: StrictBool = True  # vLLM's name; false: no BOS/EOS around prompt or content
    add_special: StrictBool | None = None  # llama-server's name for the same

    @model_validator(mode="after")
    def _one_input(self):
        given = [f for f in ("prompt", "content", "messages") if getattr(self, f) is not None]
        if len(given) != 1:
            raise field_error(given[1] if given else "prompt",
                              "give one of prompt, content or messages" + (f", not {' and '.join(given)}" if given else ""))
        if self.tools is not None and self.messages is None:
            raise field_error("tools", "tools go with messages")
        return self


class DetokenizeRequest(FieldRule):
    """``POST /detokenize``: token ids to text."""

    model: str | None = None
    tokens: list[StrictInt]


def router(state: ServerState) -> APIRouter:
    """``/tokenize`` and ``/detokenize`` over ``state``."""
    routes = APIRouter()

    @routes.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict:
        check_model(state, served_model(state, body))
        log_fields("/tokenize", body)
        if body.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            ids = await chat_prompt(state, [m.as_dict() for m in body.messages], tools)
        else:
            param = "prompt" if body.prompt is not None else "content"
            try:
                if body.add_special_tokens and body.add_special is not False:
                    ids = await state.prompts.encode(getattr(body, param), param)
                else:
                    state.prompts.check([getattr(body, param)], param)
                    ids = await state.prompts.run(state.tokenizer.encode, getattr(body, param), False)
            except PromptError as exc:
                raise APIError(400, str(exc), exc.param) from exc
        strs = state.tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}

    @routes.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(state, served_model(state, body))
        log_fields("/detokenize", body)
        vocab = state.tokenizer.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {body.tokens[bad]} is outside the vocabulary (0..{vocab - 1})", f"tokens.{bad}")
        text = await state.prompts.run(state.tokenizer.decode, body.tokens)
        return {"prompt": text, "content": text}

    return routes
