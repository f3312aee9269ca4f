"""The Batch API's state directory: one SQLite database (WAL, synchronous commits) beside the
uploaded files, and stores opened only when first needed, so that a server nobody sends files
or batches to writes nothing."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, Protocol, TypeVar

STATE_DB = "state.db"


def open_db(state_dir: Path, schema: str) -> sqlite3.Connection:
    """The state database with `schema` in place; shared by the stores of one directory."""
    state_dir.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(state_dir / STATE_DB, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.executescript(schema)
    return db


class Closable(Protocol):
    def close(self) -> None: ...


S = TypeVar("S", bound=Closable)


class Lazy(Generic[S]):
    """A store of `state_dir`, opened on first use."""

    def __init__(self, state_dir: Path, open_store: Callable[[Path], S]) -> None:
        self.state_dir = state_dir
        self._open = open_store
        self._store: S | None = None
        self._lock = threading.Lock()

    def get(self) -> S:
        with self._lock:
            if self._store is None:
                self._store = self._open(self.state_dir)
            return self._store

    def existing(self) -> S | None:
        """The store if earlier runs made the state database (a restart resumes their work),
        else None, creating nothing."""
        if self._store is None and not (self.state_dir / STATE_DB).exists():
            return None
        return self.get()

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
