"""A batch's input file checked before anything runs: every line a JSON object with a unique
`custom_id`, `method` POST, the batch's `url`, and a body the endpoint accepts. Any failure
fails the whole batch with per-line errors in OpenAI's shape; nothing is half-accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from engine.core.errors import ConveyorError
from server import json_text
from server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from server.responses_protocol import ResponsesRequest
from server.score_protocol import RerankRequest, ScoreRequest

ENDPOINTS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/score": ScoreRequest,
    "/v1/rerank": RerankRequest,
}
MAX_LINES = 50_000


def read_batch(path: Path, endpoint: str) -> tuple[list[tuple[str, dict[str, Any]]], list[dict]]:
    """The lines as (custom_id, body), and the errors (none if the file is good)."""
    lines: list[tuple[str, dict[str, Any]]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    with path.open("rb") as source:
        for number, raw in enumerate(source, 1):
            if not raw.strip():
                continue
            try:
                line = _read_line(raw, endpoint, seen)
            except _LineError as exc:
                errors.append(exc.entry(number))
                continue
            lines.append(line)
    if not lines and not errors:
        errors.append(_LineError("empty_file", "The input file has no requests.").entry(None))
    if len(lines) > MAX_LINES:
        message = f"A batch holds at most {MAX_LINES} requests, got {len(lines)}."
        errors.append(_LineError("too_many_requests", message).entry(None))
    return lines, errors


class _LineError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param

    def entry(self, line: int | None) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": line}


def _read_line(raw: bytes, endpoint: str, seen: set[str]) -> tuple[str, dict[str, Any]]:
    try:
        item = json_text.loads(raw)
    except ValueError as exc:
        raise _LineError("invalid_json_line", "This line is not valid JSON.") from exc
    if not isinstance(item, dict):
        raise _LineError("invalid_json_line", "This line is not a JSON object.")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _LineError("missing_required_parameter", "custom_id is required.", "custom_id")
    if custom_id in seen:
        raise _LineError(
            "duplicate_custom_id", f"custom_id {custom_id!r} is used twice.", "custom_id"
        )
    seen.add(custom_id)
    if item.get("method") != "POST":
        raise _LineError("invalid_method", "method must be POST.", "method")
    if item.get("url") != endpoint:
        raise _LineError("mismatched_url", f"url must be the batch's endpoint, {endpoint}.", "url")
    body = item.get("body")
    if not isinstance(body, dict):
        raise _LineError("invalid_request", "body must be a JSON object.", "body")
    if body.get("stream"):
        raise _LineError("invalid_request", "Batch requests cannot stream.", "body.stream")
    try:
        ENDPOINTS[endpoint].model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise _LineError("invalid_request", f"{where}: {error['msg']}", f"body.{where}") from exc
    except ConveyorError as exc:
        raise _LineError("invalid_request", str(exc), "body") from exc
    return custom_id, body
