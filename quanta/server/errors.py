"""Error bodies: OpenAI's ``{"error": {"message", "type", "param", "code"}}``, and
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on its routes
(``/v1/messages...``).

One rule for invalid input, on every route: HTTP 400, as OpenAI's and
Anthropic's APIs answer, never FastAPI's default 422, for malformed JSON,
a body that breaks the request schema (wrong type, out of range, missing
field) and a value the route refuses after parsing. The message names the
field (``max_tokens: ...``) and OpenAI's body names it in ``param`` too.
``/openapi.json`` documents the same: each route's 422 entry is replaced by
400 with the route's error body (:func:`document_errors`).

An unexpected exception is logged with its traceback under a short error id;
the client gets HTTP 500 with a message naming that id, never the exception's
own text (which can quote other users' input or server internals).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from quanta.engine.async_engine import RequestFailed

log = logging.getLogger("quanta.server")

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
    421: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
}

#: HTTP status -> Anthropic error type.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error",
    421: "invalid_request_error", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error",
}

#: Paths under this prefix answer with Anthropic's error body.
ANTHROPIC_PREFIX = "/v1/messages"
#: Paths under this prefix answer with Ollama's body ``{"error": message}``.
OLLAMA_PREFIX = "/api/"
#: OpenAI's Responses route (its stream's events are numbered)
RESPONSES_PATH = "/v1/responses"


class APIError(Exception):
    """An error to return to the client with HTTP ``status``, in the body of the
    route's protocol (:func:`route_error_body`); ``param`` and ``code`` appear in OpenAI's."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    """OpenAI's error body."""

    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


class OllamaError(BaseModel):
    """Ollama's error body (its message names the field)."""

    error: str


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's body (:class:`OpenAIError`)."""
    detail = OpenAIErrorDetail(message=message, type=_TYPES.get(status, "server_error"), param=param, code=code)
    return OpenAIError(error=detail).model_dump()


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's body (:class:`AnthropicError`)."""
    return AnthropicError(error=AnthropicErrorDetail(type=ANTHROPIC_ERROR_TYPES.get(status, "api_error"), message=message)).model_dump()


def route_error_body(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The error body of the API that serves ``path`` (the one place a domain error meets a protocol)."""
    if path.startswith(ANTHROPIC_PREFIX):  # Anthropic's and Ollama's bodies have no param: the message names it
        return anthropic_error_body(status, _naming(message, param))
    if path.startswith(OLLAMA_PREFIX):
        return {"error": _naming(message, param)}
    return error_body(status, message, param, code)


def _naming(message: str, param: str | None) -> str:
    """``message`` led by the field it is about, unless it already is."""
    return message if not param or message.startswith(param) else f"{param}: {message}"


def quoted(value: str, limit: int = 80) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters with the full length said
    (an error never echoes a client's megabyte back)."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value):,} characters)"


def stream_error_event(path: str, message: str, sequence_number: int = 0) -> str:
    """The SSE event that ends a stream of ``path`` which failed after its response began: Anthropic's
    ``error`` event, the Responses API's ``error`` event (numbered ``sequence_number``, the count of events
    before it), else a chat/completions chunk holding OpenAI's error body."""
    if path.startswith(ANTHROPIC_PREFIX):
        return f"event: error\ndata: {json.dumps(anthropic_error_body(500, message), ensure_ascii=False)}\n\n"
    if path.startswith(RESPONSES_PATH):
        payload = {"type": "error", "sequence_number": sequence_number, "code": "server_error", "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
    return f"data: {json.dumps(error_body(500, message))}\n\n"


def internal_error_message(error_id: str) -> str:
    return f"internal server error (error id {error_id}; details are in the server log)"


def log_internal_error(what: str, exc: BaseException) -> str:
    """Log ``exc`` with its traceback under a new error id; returns the id."""
    error_id = uuid.uuid4().hex[:12]
    log.error("%s failed (error id %s)", what, error_id, exc_info=exc)
    return error_id


#: pydantic error types that say "not this type": for a value that failed every member of a
#: union, an error of another type (a range, a length) is the one to report.
_TYPE_MISMATCH = ("_type", "literal_error", "union_tag_invalid", "model_attributes_type")


def _describe(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message naming the field, param) of the first validation error that says most."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    if errors[0].get("type") == "json_invalid":
        return _json_error(errors[0]), None
    field = _field(errors[0])
    same = [e for e in errors if _field(e)[:len(field)] == field]  # the first field's errors, one per union member
    first = next((e for e in same if not e.get("type", "").endswith(_TYPE_MISMATCH)), errors[0])
    path = _field(first)
    if first.get("type") == "field_error":  # a model validator naming its field (protocol.field_error)
        path.append(first["ctx"]["field"])
    param = ".".join(path) or None
    if param is None and first.get("type") == "missing":
        return "the request needs a JSON object body", None
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        message = "unknown field (not supported; remove it)"
    return (f"{param}: {message}" if param else message), param


def _field(error: dict) -> list[str]:
    """The error's ``loc`` as field names and indices (no ``body``, no union members)."""
    return [str(p) for p in error.get("loc", ()) if p != "body" and not _union_member(p)]


def _union_member(part) -> bool:
    """Whether a ``loc`` part names a union member (``str``, ``list[int]``, ``constrained-str``,
    ``function-after[...]``, ``NamedToolChoice``) rather than a field: fields are snake_case."""
    if not isinstance(part, str):
        return False
    return part in ("str", "int", "float", "bool", "list", "dict", "none") or any(c in part for c in "[-") or part[:1].isupper()


def _json_error(error: dict) -> str:
    """``malformed JSON body: <reason> at position N`` (FastAPI puts the character offset in ``loc``)."""
    reason = (error.get("ctx") or {}).get("error") or error.get("msg")
    pos = [p for p in error.get("loc", ()) if isinstance(p, int)]
    return f"malformed JSON body: {reason}" + (f" at position {pos[0]}" if pos else "")


#: the body as :class:`quanta.server.limits.BodyLimit` read it, in the ASGI scope
RAW_BODY = "quanta.raw_body"


def _http_message(exc: StarletteHTTPException, scope) -> tuple[str, str | None]:
    """(the detail, or for a body FastAPI could not parse (it raises 400 from the parser's error) why; param)."""
    if isinstance(exc.__cause__, RecursionError):
        return "malformed JSON body: nested too deeply", None
    if exc.status_code == 400 and isinstance(exc.__cause__, ValueError):  # JSON or UTF-8 decoding
        if "int_max_str_digits" in str(exc.__cause__):  # Python's own advice is no answer for a client
            return _long_integer(scope.get(RAW_BODY) or b"")
        return f"malformed JSON body: {exc.__cause__}", None
    return str(exc.detail), None


def _long_integer(body: bytes) -> tuple[str, str | None]:
    """The 400 for a JSON integer of more digits than Python parses, naming its field when the body shows it."""
    limit = sys.get_int_max_str_digits()
    found = re.search(rb'"([A-Za-z0-9_]{1,64})"\s*:\s*-?[0-9]{%d,}' % (limit + 1), body)
    param = found.group(1).decode() if found else None
    return f"{param + ': ' if param else ''}an integer has more than {limit} digits", param


def install_error_handlers(app: FastAPI) -> None:
    """Turn validation failures, API errors, HTTP errors and crashes into error bodies,
    and document the 400 rule in the app's OpenAPI schema (:func:`document_errors`)."""
    document_errors(app)

    def respond(request: Request, status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        return JSONResponse(route_error_body(request.url.path, status, message, param, code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe(exc)
        return respond(request, 400, message, param)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestFailed)
    async def _failed(request: Request, exc: RequestFailed) -> JSONResponse:
        return respond(request, exc.status, str(exc))  # already logged under its id by the engine; 503 when shutting down

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        error_id = log_internal_error(f"{request.method} {request.url.path}", exc)
        return respond(request, 500, internal_error_message(error_id))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = respond(request, exc.status_code, *_http_message(exc, request.scope))
        response.headers.update(exc.headers or {})
        return response


def _error_model(path: str) -> type[BaseModel]:
    if path.startswith(ANTHROPIC_PREFIX):
        return AnthropicError
    return OllamaError if path.startswith(OLLAMA_PREFIX) else OpenAIError


def document_errors(app: FastAPI) -> None:
    """Make ``app.openapi()`` state the 400 rule: every operation's ``422`` response
    (FastAPI's default) becomes ``400`` with the route's error body
    (:class:`OpenAIError`, :class:`AnthropicError` under :data:`ANTHROPIC_PREFIX`,
    :class:`OllamaError` under :data:`OLLAMA_PREFIX`)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (OpenAIError, AnthropicError, OllamaError):
            definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(definition.pop("$defs", {}))
            components[model.__name__] = definition
        for path, operations in schema.get("paths", {}).items():
            body = _error_model(path)
            for operation in operations.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = {"description": "Invalid request (malformed JSON, schema or value)", "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        return schema

    app.openapi = openapi
