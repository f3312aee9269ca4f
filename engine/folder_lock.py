"""One process at a time over a shared folder of the cache (a kernel build, a model conversion):
an advisory `flock` that the kernel drops with its holder, however the holder exits, so a process
killed midway never blocks the next. The holder writes its process id into the lock file, and a
process that has to wait logs whom it waits for."""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def held(path: Path, doing: str, logger: logging.Logger) -> Iterator[None]:
    """Hold the lock file at `path`; waiting for a live holder logs (on `logger`) `waiting for
    process PID, which is DOING`."""
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "another process"
            logger.info("waiting for process %s, which is %s", owner, doing)
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
