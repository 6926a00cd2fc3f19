"""Error bodies: OpenAI's ``{"error": {"message", "type", "param", "code"}}``, and
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on its routes
(``/v1/messages...``).

An unexpected exception is logged with its traceback under a short error id;
the client gets HTTP 500 with a message naming that id, never the exception's
own text (which can quote other users' input or server internals).
"""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
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


class APIError(Exception):
    """An error to return to the client with HTTP ``status``, in the body of the
    route's protocol (:func:`route_error_body`); ``param`` and ``code`` appear in OpenAI's."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


def route_error_body(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The error body of the API that serves ``path`` (the one place a domain error meets a protocol)."""
    if path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error_body(status, message)
    return error_body(status, message, param, code)


def internal_error_message(error_id: str) -> str:
    return f"internal server error (error id {error_id}; details are in the server log)"


def log_internal_error(what: str, exc: BaseException) -> str:
    """Log ``exc`` with its traceback under a new error id; returns the id."""
    error_id = uuid.uuid4().hex[:12]
    log.error("%s failed (error id %s)", what, error_id, exc_info=exc)
    return error_id


def _describe(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return _json_error(first), None
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    return (f"{param}: {message}" if param else message), param


def _json_error(error: dict) -> str:
    """``malformed JSON body: <reason> at position N`` (FastAPI puts the character offset in ``loc``)."""
    reason = (error.get("ctx") or {}).get("error") or error.get("msg")
    pos = [p for p in error.get("loc", ()) if isinstance(p, int)]
    return f"malformed JSON body: {reason}" + (f" at position {pos[0]}" if pos else "")


def install_error_handlers(app: FastAPI) -> None:
    """Turn validation failures, API errors, HTTP errors and crashes into error bodies."""

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
        return respond(request, 500, str(exc))  # already logged under its id by the engine

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        error_id = log_internal_error(f"{request.method} {request.url.path}", exc)
        return respond(request, 500, internal_error_message(error_id))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = respond(request, exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})
        return response
