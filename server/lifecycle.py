"""Graceful shutdown: stop accepting, let running requests finish, then end the rest with a
503 (a JSON error, or an error event and `[DONE]` on a stream)."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

from engine.core.errors import EngineDeadError
from server.settings import TlsFiles
from server.tls_refresh import POLL_SECONDS, CertificateWatcher

logger = logging.getLogger("conveyor")


def freeze_heap() -> int:
    """Move every object alive once the model is loaded (torch, transformers, the weights'
    wrappers: hundreds of thousands) out of the garbage collector's sight, as vLLM does: each
    full collection otherwise walks them all, about 250 ms on a small CPU, holding the event
    loop and the step alike. Returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Give the frozen objects back to the collector once serving is over, so the interpreter's
    last collection frees what they hold (Triton's bindings otherwise report each object still
    alive at exit as a leak)."""
    gc.unfreeze()


# What the handlers get, once `shutdown_timeout` has passed, to send their errors before uvicorn
# cancels them.
ANSWER_SECONDS = 5.0


class DrainingServer(uvicorn.Server):
    """On SIGTERM or Ctrl-C new requests get 503 while running ones finish. Requests still
    running after `shutdown_timeout` seconds end with a 503 error their clients can read; then
    uvicorn closes the connections and the app's lifespan stops the engine."""

    def __init__(
        self,
        config: uvicorn.Config,
        app: FastAPI,
        shutdown_timeout: float,
        refreshed_tls: TlsFiles | None = None,
        refresh_seconds: float = POLL_SECONDS,
    ) -> None:
        config.timeout_graceful_shutdown = int(shutdown_timeout + ANSWER_SECONDS) + 1
        super().__init__(config)
        self._app = app
        self._shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        # `--enable-ssl-refresh`: these files are watched once the server listens.
        self._refreshed_tls = refreshed_tls
        self._refresh_seconds = refresh_seconds
        self.certificates: CertificateWatcher | None = None
        self._watching: asyncio.Task[None] | None = None

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        context = self.config.ssl
        if self._refreshed_tls is not None and context is not None:
            self.certificates = CertificateWatcher(
                context, self._refreshed_tls, self._refresh_seconds
            )
            self._watching = asyncio.create_task(self.certificates.run())

    async def shutdown(self, sockets: list | None = None) -> None:
        if self._watching is not None:
            self._watching.cancel()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self._app.state.draining
        if first and sig in (signal.SIGINT, signal.SIGTERM):
            logger.info(
                "shutting down: finishing running requests (up to %ss)", self._shutdown_timeout
            )
        self._app.state.draining = True
        if first and self._loop is not None:
            self._loop.call_soon_threadsafe(
                self._loop.call_later, self._shutdown_timeout, self._end_the_rest
            )
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after shutting down, which would end the process
        # with -SIGTERM; a completed graceful shutdown exits 0 instead.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()

    def _end_the_rest(self) -> None:
        engine = self._app.state.engine
        if engine.num_unfinished:
            logger.warning(
                "shutdown timeout: ending %d requests still running", engine.num_unfinished
            )
        engine.fail_all(EngineDeadError("The server shut down before this request finished."))
