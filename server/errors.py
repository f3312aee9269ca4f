"""Every error a client can see, in OpenAI's shape (Anthropic's on its Messages routes), mapped
in one place."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from engine.core.errors import (
    ConveyorError,
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
    RequestTimeoutError,
)

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error raised by the server layer itself, already carrying its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(
    message: str, type_: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the status and body a client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, QueueFullError):
        return APIError(
            503,
            exc.message,
            "server_error",
            code=exc.code,
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, exc.message, "server_error", code="timeout")
    if isinstance(exc, EngineDeadError):
        return APIError(503, exc.message, "server_error", code="engine_unavailable")
    if isinstance(exc, RequestFailedError | ConveyorError):
        return APIError(500, exc.message, "server_error", code=exc.code)
    logger.error("unexpected error", exc_info=exc)
    return APIError(500, f"Internal server error: {type(exc).__name__}", "server_error")


# Anthropic's error types by status (`/v1/messages` answers in Anthropic's shape).
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages",)


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, as Anthropic's API and SDKs shape an
    error (a 5xx other than an overload is an `api_error`)."""
    fallback = "invalid_request_error" if error.status < 500 else "api_error"
    kind = ANTHROPIC_TYPES.get(error.status, fallback)
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_json(error: APIError, path: str = "") -> dict[str, Any]:
    """The error's body, in Anthropic's shape on its routes and OpenAI's elsewhere."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_body(error)
    return error_body(error.message, error.type, error.param, error.code)


def error_response(exc: BaseException, path: str = "") -> JSONResponse:
    error = to_api_error(exc)
    return JSONResponse(error_json(error, path), status_code=error.status, headers=error.headers)


# Names pydantic gives the members of a union in an error's location: not the client's fields.
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _param(location: tuple | list) -> str | None:
    """The field an error is about, as the client named it: `messages.0.content`, with the
    union member pydantic tried (`str`, `list[int]`, `constrained-str`, ...) left out."""
    parts: list[str] = []
    for part in location:
        if part in ("body", "query", "path"):
            continue
        text = str(part)
        if not (isinstance(part, int) or text.isidentifier()) or text in _UNION_MEMBERS:
            break
        parts.append(text)
    return ".".join(parts) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    param = _param(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    message = first.get("msg", "Invalid value")
    return (f"Invalid value for '{param}': {message}." if param else f"{message}."), param


def _allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Every method some route serves at this path (Starlette names only the first route's,
    where a path has one route per method)."""
    methods: set[str] = set()
    for route in _leaf_routes(app.router.routes):
        match, _ = route.matches({**scope, "method": ""})
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def _leaf_routes(routes: list[Any]) -> Iterator[Any]:
    """The routes themselves, through the routers included (without prefixes) in the app."""
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            yield from _leaf_routes(included.routes)
        else:
            yield route


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(_allowed_methods(app, request.scope))
        error = APIError(exc.status_code, str(exc.detail), type_, headers=headers)
        return error_response(error, request.url.path)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(ConveyorError)
    async def _engine(request: Request, exc: ConveyorError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc, request.url.path)
