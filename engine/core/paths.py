"""Where Conveyor keeps what it writes: models, compiled kernels, server state."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$CONVEYOR_CACHE`, else `conveyor` under the user's cache folder."""
    explicit = os.environ.get("CONVEYOR_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "conveyor"
