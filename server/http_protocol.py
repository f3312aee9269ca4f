"""The HTTP/1.1 connection: uvicorn's httptools protocol with two guards on a request's head
(its request line and headers), which httptools itself does not bound:

- size: a head over `max_head_bytes`, or of more than `max_head_count` header lines, gets a
  431 and the connection is closed, before the parser has buffered more than that (a client
  cannot make the server hold a 200 MB header, or a million small ones);
- time: a head must arrive within `head_timeout` seconds of the connection opening or of the
  previous response ending, so a connection that sends nothing, or trickles its headers a byte
  at a time, is closed (with a 408 if it had begun a request).

Idle keep-alive connections are closed after uvicorn's `timeout_keep_alive` (5 s).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from http import HTTPStatus
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.errors import error_body
from server.log_format import quiet_access_log
from server.settings import (
    DEFAULT_HEAD_TIMEOUT,
    DEFAULT_MAX_HEAD_BYTES,
    DEFAULT_MAX_HEAD_COUNT,
    ServerSettings,
)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """httptools with a bounded head; subclassed per server with its limits (`guarded`)."""

    max_head_bytes = DEFAULT_MAX_HEAD_BYTES
    max_head_count = DEFAULT_MAX_HEAD_COUNT
    head_timeout = DEFAULT_HEAD_TIMEOUT

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._head_count = 0
        self._reading_head = True
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Count what arrives while a head is awaited; a chunk may end the head and go on into
        the body, so only a head still unfinished after it counts as too large (the parser
        then holds at most the limit plus one chunk)."""
        if self._reading_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._head_count > self.max_head_count:
            self._refuse(431, f"The request has more than {self.max_head_count} headers.")
        elif self._reading_head and self._head_bytes > self.max_head_bytes:
            self._refuse(431, f"The request head is over {self.max_head_bytes} bytes.")

    def on_header(self, name: bytes, value: bytes) -> None:
        """Keep a head's first `max_head_count` headers; past them, the request is refused
        once the parser returns (its app never runs)."""
        self._head_count += 1
        if self._head_count <= self.max_head_count:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._cancel_head_timer()
        if self._head_count <= self.max_head_count:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._head_count <= self.max_head_count:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._head_count > self.max_head_count:
            return
        super().on_message_complete()
        # What follows on this connection is the head of the next request.
        self._reading_head, self._head_bytes, self._head_count = True, 0, 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_too_slow)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._reading_head:
            return
        if self._head_bytes:
            self._refuse(408, f"The request head did not arrive within {self.head_timeout:g} s.")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """An error in OpenAI's shape, then close; while a response is still being sent on this
        connection (pipelining), only close."""
        self._reading_head = False
        self._cancel_head_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()
            return
        body = json.dumps(error_body(message, "invalid_request_error")).encode()
        reason = HTTPStatus(status).phrase.encode()
        head = (
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, reason, len(body))
        )
        self.transport.write(head + body)
        self.transport.close()


def guarded(
    max_head_bytes: int, head_timeout: float, max_head_count: int = DEFAULT_MAX_HEAD_COUNT
) -> type[GuardedHttpToolsProtocol]:
    """The protocol class with these limits."""
    limits = {
        "max_head_bytes": max_head_bytes,
        "head_timeout": head_timeout,
        "max_head_count": max_head_count,
    }
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), limits)


def uvicorn_config(
    app: Any,
    host: str,
    port: int,
    log_level: str,
    settings: ServerSettings,
    log_config: dict[str, Any] | None = None,
    uds: str | None = None,
) -> uvicorn.Config:
    """uvicorn's configuration for the app: the guarded protocol with `settings`' limits, its
    TLS files and root path, and `log_config` for its loggers (None: uvicorn's own); on the
    Unix domain socket `uds` instead of `host` and `port` where one is named."""
    tls = settings.tls
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        uds=uds,
        log_level=log_level,
        http=guarded(settings.max_head_bytes, settings.head_timeout, settings.max_head_count),
        log_config=log_config if log_config is not None else uvicorn.config.LOGGING_CONFIG,
        root_path=settings.root_path,
        access_log=settings.access_log,
        ssl_keyfile=tls.keyfile if tls else None,
        ssl_certfile=tls.certfile if tls else None,
        ssl_ca_certs=tls.ca_certs if tls else None,
        ssl_cert_reqs=tls.cert_reqs if tls else ssl.CERT_NONE,
        ssl_ciphers=tls.ciphers if tls else None,
    )
    # After uvicorn has configured its loggers.
    quiet_access_log(settings.quiet_paths, settings.root_path)
    return config
