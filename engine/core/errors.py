"""Typed errors that users of the engine can cause or observe.

The server maps each class to an HTTP status and OpenAI's error shape in one place; the engine never
speaks HTTP.
"""

from __future__ import annotations


class ConveyorError(Exception):
    """Base class of every error the engine raises on purpose."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(ConveyorError):
    """A request parameter is out of range or inconsistent."""


class PromptTooLongError(InvalidRequestError):
    """The prompt can never fit: longer than the context or than the whole KV cache."""


class QueueFullError(ConveyorError):
    """The waiting queue is full; the client should retry later."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message, code="queue_full")
        self.retry_after = retry_after


class EngineDeadError(ConveyorError):
    """The engine loop is not running (stopped, shutting down or crashed)."""


class RequestFailedError(ConveyorError):
    """A model step failed while this request was part of it."""


class RequestTimeoutError(ConveyorError):
    """The request's deadline passed (or could not be met) before it produced its answer."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="timeout")


class WorkerFailedError(EngineDeadError):
    """A tensor-parallel worker died or a step failed across the ranks: the engine stops."""
