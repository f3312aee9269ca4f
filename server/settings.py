"""Server settings (frozen): what the HTTP layer needs beyond the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.limits import RequestLimits

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServerSettings:
    served_model_name: str | None = None
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout: float = 30.0
    limits: RequestLimits = field(default_factory=RequestLimits)
    # How calls are read from free text under tool_choice "auto" (None: from the chat template).
    tool_call_parser: str | None = None
