"""Server settings (frozen): what the HTTP layer needs beyond the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.json_style import PLAIN, JsonStyle
from server.limits import RequestLimits

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# A request's line and headers: at most this many bytes, arriving within this many seconds.
# The most header lines a request may carry (vLLM's `--h11-max-header-count` default).
DEFAULT_MAX_HEAD_COUNT = 256
DEFAULT_MAX_HEAD_BYTES = 64 * 1024
DEFAULT_HEAD_TIMEOUT = 30.0
# An uploaded file (/v1/files), as OpenAI's limit for a batch's input.
DEFAULT_MAX_FILE_BYTES = 200 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """HTTPS (`--ssl-keyfile`, `--ssl-certfile`; `--ssl-ca-certs` and `--ssl-cert-reqs` to ask
    clients for certificates of that authority): files as uvicorn reads them."""

    keyfile: str
    certfile: str
    ca_certs: str | None = None
    cert_reqs: int = 0  # ssl.CERT_NONE; 1 optional, 2 required
    # The TLS 1.2 ciphers offered, in OpenSSL's syntax (`--ssl-ciphers`; None: Python's).
    ciphers: str | None = None
    # The files re-read when they change (`--enable-ssl-refresh`, `server/tls_refresh.py`).
    refresh: bool = False


@dataclass(frozen=True, slots=True)
class CorsOptions:
    """vLLM's `--allowed-methods`, `--allowed-headers` and `--allow-credentials`."""

    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


@dataclass(frozen=True, slots=True)
class ServerSettings:
    served_model_name: str | None = None
    # More names clients may send as `model` for the served model.
    served_model_aliases: tuple[str, ...] = ()
    # A chat template used instead of the model's own (`--chat-template`).
    chat_template: str | None = None
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    # What browsers may send under CORS (only where `allowed_origins` turns it on).
    cors: CorsOptions = CorsOptions()
    # A deployment's own ASGI middleware by import path (`--middleware`, vLLM's flag).
    middleware: tuple[str, ...] = ()
    # HTTPS with these files (None: plain HTTP).
    tls: TlsFiles | None = None
    # The path a proxy serves the app under (`--root-path`), for the links the app writes.
    root_path: str = ""
    # Seconds between the engine's stats lines in the log (None: none, `--disable-log-stats`).
    log_stats_interval: float | None = 10.0
    # uvicorn's line per HTTP request (`--disable-uvicorn-access-log`).
    access_log: bool = True
    # Paths whose requests get no such line (`--disable-access-log-for-endpoints`: health
    # checks and scrapes).
    quiet_paths: tuple[str, ...] = ()
    # The API's description and its pages at /docs and /redoc (`--disable-fastapi-docs`).
    api_docs: bool = True
    # What every completion and chat request gets, whatever it asks (vLLM's flags): a streamed
    # one its usage last (`--enable-force-include-usage`), logprobs naming tokens by their ids
    # (`--return-tokens-as-token-ids`).
    force_include_usage: bool = False
    return_tokens_as_token_ids: bool = False
    # A lone sequence's response carries its timings (`--enable-per-request-metrics`).
    per_request_metrics: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    max_head_count: int = DEFAULT_MAX_HEAD_COUNT
    head_timeout: float = DEFAULT_HEAD_TIMEOUT
    shutdown_timeout: float = 30.0
    limits: RequestLimits = field(default_factory=RequestLimits)
    # How chat templates take a message's content (`--chat-template-content-format`: auto,
    # string or openai) and the role of a chat reply (`--response-role`).
    chat_content_format: str = "auto"
    response_role: str = "assistant"
    # Template variables of every chat request, under its own `chat_template_kwargs`.
    default_chat_template_kwargs: dict[str, Any] | None = None
    # How calls are read from free text under tool_choice "auto" (None: from the chat template).
    tool_call_parser: str | None = None
    # Under `tool_choice` "none" the prompt leaves the tools out
    # (`--exclude-tools-when-tool-choice-none`); by default it shows them, as vLLM's.
    exclude_tools_when_tool_choice_none: bool = False
    # Splits a thinking model's reasoning from its answer (None: the reply is all content).
    reasoning_parser: str | None = None
    # Where request spans go over OTLP/HTTP (None: the environment's, else no tracing).
    otlp_traces_endpoint: str | None = None
    # A log line for every finished request (`--log-format json`).
    log_requests: bool = False
    # That line holds each choice's text (`--enable-log-outputs`), cut to `max_log_len`
    # characters (`--max-log-len`; None: whole).
    log_outputs: bool = False
    max_log_len: int | None = None
    # Where uploaded files and batch jobs are kept (None: `state` under the cache folder).
    state_dir: Path | None = None
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (clients then name folders to read).
    runtime_lora_updating: bool = False
    # /pause, /resume, /is_paused and /abort_requests (`--server-dev-mode`).
    server_dev_mode: bool = False
    # How enforced JSON is written (`--structured-outputs-config`'s options).
    json_style: JsonStyle = PLAIN
    # /v1/completions takes `prompt_embeds` (`--enable-prompt-embeds`).
    enable_prompt_embeds: bool = False
    # GET /tokenizer_info (`--enable-tokenizer-info-endpoint`).
    tokenizer_info_endpoint: bool = False
    # Requests may bring their own chat template (`--trust-request-chat-template`).
    trust_request_chat_template: bool = False
    # More arguments of every call of an image-text model's processor (`--mm-processor-kwargs`,
    # e.g. Qwen2-VL's `max_pixels`).
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
