"""Ollama's API over the shared request core: what Open WebUI, Continue, Zed and the
``ollama`` Python and JavaScript clients speak.

Routes: ``POST /api/chat`` and ``POST /api/generate``
(:mod:`quanta.server.ollama.generation`; bodies in
:mod:`quanta.server.ollama.requests` and :mod:`quanta.server.ollama.options`,
answers in :mod:`quanta.server.ollama.shapes`), ``GET /api/tags``,
``POST /api/show``, ``GET /api/ps`` (:mod:`quanta.server.ollama.models`) and
``GET /api/version``. ``/api/embed`` and ``/api/embeddings`` answer 501 (no
embedding model is served), as do the model-management routes (``pull``,
``push``, ``create``, ``copy``, ``delete``): the server serves the model it
was started with. Every error is Ollama's body ``{"error": "message"}``
(:func:`quanta.server.errors.route_error_body`), 400 for a bad field (named
in the message), 404 for a model the server does not serve.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from quanta.server.errors import APIError
from quanta.server.ollama.generation import serve_chat, serve_generate
from quanta.server.ollama.models import OLLAMA_API_VERSION, ModelFacts, resolve
from quanta.server.ollama.requests import ChatBody, GenerateBody, ShowBody

#: the routes that answer 501, and why
UNSUPPORTED = {
    "/api/embed": "embeddings are not supported: the server serves a generation model",
    "/api/embeddings": "embeddings are not supported: the server serves a generation model",
    "/api/pull": "pulling models is not supported: the server serves the model it was started with",
    "/api/push": "pushing models is not supported: the server serves the model it was started with",
    "/api/create": "creating models is not supported: the server serves the model it was started with",
    "/api/copy": "copying models is not supported: start the server with --served-model-name for another name",
    "/api/delete": "deleting models is not supported: the server serves the model it was started with",
}


def router(state) -> APIRouter:
    """Ollama's routes over ``state`` (a :class:`quanta.server.serving.ServerState`)."""
    routes = APIRouter()
    facts = ModelFacts(state)

    @routes.post("/api/chat")
    async def chat(body: ChatBody, request: Request) -> Response:
        return await serve_chat(state, request, body)

    @routes.post("/api/generate")
    async def generate(body: GenerateBody, request: Request) -> Response:
        return await serve_generate(state, request, body)

    @routes.get("/api/tags")
    async def tags() -> dict:
        return {"models": [facts.listing(name) for name in state.model_names]}

    @routes.get("/api/ps")
    async def ps() -> dict:
        return {"models": [facts.running(state.model_name)]}

    @routes.post("/api/show")
    async def show(body: ShowBody) -> dict:
        if not body.wanted:
            raise APIError(400, "model: required (the model to show)", "model")
        return facts.show(resolve(state, body.wanted))

    @routes.get("/api/version")
    async def version() -> dict:
        return {"version": OLLAMA_API_VERSION}

    for path, reason in UNSUPPORTED.items():
        routes.add_api_route(path, _unsupported(reason), methods=["DELETE" if path == "/api/delete" else "POST"],
                             include_in_schema=False)
    return routes


def _unsupported(reason: str):
    async def answer() -> Response:
        raise APIError(501, reason)
    return answer
