"""What `/openapi.json` says each route answers: the status codes the server really returns,
with OpenAI's error body, and the content types it sends. Clients generate SDKs and gateways
from this document, so it must match the server."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from server.messages_protocol import AnthropicErrorResponse
from server.protocol import ErrorResponse

DESCRIPTIONS = {
    400: "Invalid request: bad JSON, a parameter out of range, a list past its limit",
    401: "Missing or wrong API key",
    404: "Unknown model, or no stored response of that id",
    409: "A resume came before the pause took effect",
    500: "The model step failed for this request",
    503: "Overloaded (with Retry-After), or shutting down",
    504: "The request's deadline passed before it was served",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": DESCRIPTIONS[code]} for code in codes}


def anthropic_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The same errors in Anthropic's shape (the Messages routes)."""
    return {
        code: {"model": AnthropicErrorResponse, "description": DESCRIPTIONS[code]} for code in codes
    }


# One server-sent event of a stream: its `data` is a JSON chunk, an error, or `[DONE]`.
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}

# /v1/completions and /v1/chat/completions: JSON, or server-sent events with `stream`.
GENERATION: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion; with `stream`, its server-sent events",
        "content": {
            "text/event-stream": {
                # The events one by one, and the stream as their sequence (OpenAPI 3.2).
                "itemSchema": SSE_EVENT,
                "schema": {"type": "array", "items": SSE_EVENT},
            }
        },
    },
    **errors(400, 404, 500, 503, 504),
}


# /v1/messages: Anthropic's message, or its server-sent events with `stream`.
MESSAGES: dict[int | str, dict[str, Any]] = {
    200: GENERATION[200],
    **anthropic_errors(400, 404, 500, 503, 504),
}


# /v1/embeddings: JSON only.
EMBEDDING: dict[int | str, dict[str, Any]] = {
    200: {"description": "One embedding per input"},
    **errors(400, 404, 500, 503, 504),
}


def document_errors_as_sent(app: FastAPI) -> None:
    """FastAPI documents a 422 for every body; Conveyor answers a bad body with a 400 in
    OpenAI's shape instead, so the 422 and its schemas are left out."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
