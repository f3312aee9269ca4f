"""SageMaker's `/invocations` body, as vLLM reads it: any JSON object, made into the request
of the API its fields name (`messages`: chat, `prompt` or `prompt_embeds`: a completion,
`input`: an embedding or a classification)."""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from engine.core.errors import InvalidRequestError
from server import json_text

Body = TypeVar("Body", bound=BaseModel)

# The request body /openapi.json documents: one of the APIs' own requests.
INVOKED = ("ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest")
INVOCATION_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {"anyOf": [{"$ref": f"#/components/schemas/{name}"} for name in INVOKED]}
            }
        },
    }
}


async def invocation_body(request: Request) -> dict[str, Any]:
    """The request's JSON object."""
    try:
        body = json_text.loads(await request.body())
    except ValueError:  # not UTF-8, not JSON, or nested past reading
        raise InvalidRequestError("The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.")
    return body


def validated(model: type[Body], body: dict[str, Any]) -> Body:
    """`body` as the request `model`; a field that does not fit is a 400 naming it, as the
    API's own route answers."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in exc.errors()]
        ) from None
