"""Pure ASGI middleware (safe with streaming): request ids, the API key, a request body limit
and the last word on unexpected errors."""

from __future__ import annotations

import hmac
import json
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, error_json, error_response

REQUEST_ID_HEADER = b"x-request-id"
# A client's request id longer than this, or with characters other than these, is replaced by a
# fresh one rather than echoed (and logged) back.
MAX_REQUEST_ID = 128
REQUEST_ID_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


def plain_request_id(request_id: bytes) -> bool:
    """Whether a client's request id is echoed (and logged) as it is: short, and of plain
    characters only."""
    return len(request_id) <= MAX_REQUEST_ID and set(request_id) <= REQUEST_ID_CHARS


class RequestIdMiddleware:
    """Echo the client's X-Request-Id where it is a short plain token, or give the response a
    fresh one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, REQUEST_ID_HEADER)
        plain = given is not None and plain_request_id(given)
        request_id = given if given is not None and plain else uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = request_id.decode("latin-1")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != REQUEST_ID_HEADER]
                message["headers"] = [*headers, (REQUEST_ID_HEADER, request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` with a 400 in OpenAI's shape.

    The body is read up front (counting bytes even without a Content-Length) and replayed to
    the app, so the refusal comes before any parsing. Bodies of the `streamed` paths (uploads)
    are not held in memory: they have a limit of their own, checked against their declared
    length up front and counted as they stream (past it, the app sees the client leave).
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, streamed: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.streamed = streamed or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        streamed = self.streamed.get(scope.get("path", ""))
        limit = streamed if streamed is not None else self.max_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(send, scope, limit)
            return
        if streamed is not None:
            await self.app(scope, _counted(receive, streamed), send)
            return
        buffered = await self._read_body(receive)
        if buffered is None:
            await self._refuse(send, scope, self.max_bytes)
            return

        async def replay() -> Message:
            if buffered:
                return buffered.pop(0)
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> list[Message] | None:
        """The request's messages up to the end of its body, or None if it is too large."""
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return None
            if not message.get("more_body", False):
                return messages

    async def _refuse(self, send: Send, scope: Scope, limit: int) -> None:
        await send_error(
            send,
            scope,
            400,
            f"The request body is larger than the limit of {limit} bytes.",
            "request_too_large",
        )


class ApiKeyMiddleware:
    """Refuse requests without the API key (`Authorization: Bearer <key>`, or Anthropic's
    `x-api-key`) with a 401 in
    OpenAI's shape, before their body is read: an unauthenticated client cannot make the server
    buffer or parse anything. `/health` (and SageMaker's `/ping`), `/metrics`, `/version`, the
    load routers poll (`/get_load`, `/load`: a count `/metrics` shows too) and CORS preflights
    stay open."""

    OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/get_load", "/load"})

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") == "OPTIONS"
            or scope.get("path") in self.OPEN_PATHS
            or self._authorized(scope)
        ):
            await self.app(scope, receive, send)
            return
        await send_error(
            send,
            scope,
            401,
            "Incorrect API key provided.",
            "invalid_api_key",
            [(b"www-authenticate", b"Bearer")],
        )

    def _authorized(self, scope: Scope) -> bool:
        """`Authorization: Bearer <key>`, or `x-api-key: <key>` as Anthropic's clients send
        it."""
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token, self.key):
            return True
        other = _header(scope, b"x-api-key")
        return other is not None and hmac.compare_digest(other, self.key)


async def send_error(
    send: Send,
    scope: Scope,
    status: int,
    message: str,
    code: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """A whole error response in the route's shape (OpenAI's, or Anthropic's on its Messages
    routes), sent from middleware (the app's error handlers are not reached)."""
    error = APIError(status, message, code=code)
    body = json.dumps(error_json(error, scope.get("path", ""))).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                *(headers or []),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _counted(receive: Receive, limit: int) -> Receive:
    """`receive` that counts the body as it streams; past `limit` the app sees the client
    leave."""
    size = 0

    async def counted() -> Message:
        nonlocal size
        message = await receive()
        size += len(message.get("body", b""))
        return {"type": "http.disconnect"} if size > limit else message

    return counted


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value
    return None


class UnexpectedErrorMiddleware:
    """An exception no handler took, raised before the response started, becomes a 500 in
    OpenAI's shape here (logged once with its traceback by `server.errors`). Left to the
    framework's last handler, the same 500 would be sent and the exception raised on to the
    server, which then closes the kept-alive connection under the client's next request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            await error_response(exc, scope.get("path", ""))(scope, receive, send)
