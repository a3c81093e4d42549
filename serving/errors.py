"""OpenAI-style error bodies and the exception handlers that produce them.

Every error leaves the server as

    {"error": {"message": str, "type": str, "param": str | null, "code": str | int | null}}

with: 400 invalid request (pydantic validation included, FastAPI's 422 becomes 400; a body that is
not JSON has param null), 401 bad or missing API key, 404 unknown route or model (model_not_found),
413 body too large, 429 a key's rate limit (type "requests" or "tokens", as OpenAI's;
serving/ratelimit.py), 503 queue full / engine down / shutting down (queue full and shutting down
with Retry-After), 504 deadline exceeded. Bad input never
reaches the 500 handler; that one exists so a bug still answers in the same shape.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import EngineDeadError, EngineError, InvalidRequestError, QueueFullError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
    500: "internal_server_error",
}


RETRY_AFTER_S = 1
"""Seconds a client is told to wait (Retry-After) when the server is full or shutting down."""


class APIError(Exception):
    """An error the routes raise on purpose; turned into an OpenAI error body. `retry_after` (seconds)
    becomes a Retry-After header: the request was refused for load, not for what it asked."""

    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        code: Any = None,
        *,
        retry_after: Optional[int] = None,
        type: Optional[str] = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after
        self.type = type
        """The body's "type" when not the status's usual one (a rate limit's "requests" / "tokens")."""

    @property
    def headers(self) -> Optional[dict]:
        return None if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def response(self) -> JSONResponse:
        """The OpenAI-shaped error response of this error (its Retry-After header included)."""
        return error_response(self.status, self.message, self.param, self.code, self.headers, self.type)


def error_body(
    status: int, message: str, param: Optional[str] = None, code: Any = None, type: Optional[str] = None
) -> dict:
    kind = type or _TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    param: Optional[str] = None,
    code: Any = None,
    headers: Optional[dict] = None,
    type: Optional[str] = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, type), status_code=status, headers=headers)


def bad_request(message: str, param: Optional[str], code: str = "invalid_request") -> APIError:
    """A 400 naming the request parameter `param` that is wrong."""
    return APIError(400, message, param, code)


def queue_full(message: str) -> APIError:
    """The 503 of a full server or pool: code queue_full, with Retry-After."""
    return APIError(503, message, None, "queue_full", retry_after=RETRY_AFTER_S)


def to_api_error(exc: BaseException) -> APIError:
    """Map an engine (or serving) exception to the APIError the client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), exc.param, "invalid_request")
    if isinstance(exc, QueueFullError):
        return queue_full(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), None, "engine_unavailable")
    logger.exception("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", None, "internal_error")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _param_path(loc: tuple) -> Optional[str]:
    """'messages.0.content' from pydantic's loc, without 'body' and union-member tags like 'list[int]'."""
    parts = []
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, str) and ("[" in p or p in _TYPE_TAGS or p.startswith(("function-", "constrained-"))):
            break
        parts.append(str(p))
    return ".".join(parts) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}", None
    param = _param_path(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        err = to_api_error(exc)
        return error_response(err.status, err.message, err.param, err.code, err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param, "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = "not found: no such route"
        return error_response(exc.status_code, message, None, None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _other(_: Request, exc: Exception) -> JSONResponse:
        return to_api_error(exc).response()
