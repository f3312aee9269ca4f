"""Graceful shutdown: stop accepting, let running requests finish, then abort the rest."""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger("conveyor")


class DrainingServer(uvicorn.Server):
    """On SIGTERM or Ctrl-C new requests get 503 while running ones finish; uvicorn waits up to
    its graceful timeout, cancels what is left (aborting those requests), and the app's lifespan
    stops the engine."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self._app.state.draining and sig in (signal.SIGINT, signal.SIGTERM):
            logger.info("shutting down: finishing running requests (up to %ss)",
                        self.config.timeout_graceful_shutdown)
        self._app.state.draining = True
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after shutting down, which would end the process
        # with -SIGTERM; a completed graceful shutdown exits 0 instead.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()
