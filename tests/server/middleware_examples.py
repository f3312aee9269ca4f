"""Middleware a deployment might name with `--middleware` (imported by path in the tests)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

SEEN: list[str] = []


class StampMiddleware:
    """Plain ASGI middleware: every response carries `x-stamp: class`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def stamped(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-stamp", b"class")]
            await send(message)

        await self.app(scope, receive, stamped)


async def tenant_gate(request: Request, call_next: Any) -> Response:
    """An HTTP function: refuses requests without an `x-tenant` header, records the others."""
    tenant = request.headers.get("x-tenant")
    if tenant is None:
        return JSONResponse({"error": {"message": "no tenant"}}, status_code=403)
    SEEN.append(tenant)
    return await call_next(request)


def not_middleware() -> None:
    """Neither a class nor an async function."""
