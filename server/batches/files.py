"""Uploaded files, durable: each file's bytes under `<state_dir>/files/<id>` (written to a temporary
name, synced, then renamed, so a crash leaves either the whole file or none), and its record in
SQLite (WAL) under `<state_dir>/state.db`, committed only once the bytes are on disk.

SQLite calls block; the routes run them on a worker thread.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from server.batches.state import open_db

PURPOSES = ("batch", "batch_output", "user_data")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    seq INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS files_by_seq ON files (seq);
"""


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": None,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


class FileStore:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = open_db(state_dir, SCHEMA)
        self._remove_leftovers()

    def add(self, source: IO[bytes], filename: str, purpose: str) -> FileRecord:
        """Copy `source` in whole and durably, then record it."""
        file_id = f"file-{uuid.uuid4().hex}"
        final = self.dir / file_id
        partial = final.with_suffix(".partial")
        with partial.open("wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
        partial.rename(final)
        _sync_dir(self.dir)
        record = FileRecord(file_id, filename, purpose, size, int(time.time()))
        with self._lock, self._db:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM files").fetchone()[0]
            self._db.execute(
                "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                (record.id, filename, purpose, size, record.created_at, seq),
            )
        return record

    def get(self, file_id: str) -> FileRecord | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, filename, purpose, bytes, created_at FROM files WHERE id = ?",
                (file_id,),
            ).fetchone()
        return FileRecord(*row) if row else None

    def list(
        self, purpose: str | None, limit: int, after: str | None, newest_first: bool
    ) -> tuple[list[FileRecord], bool]:
        """A page of files in upload order (or its reverse) after the file `after`, and whether
        more follow."""
        order, compare = ("DESC", "<") if newest_first else ("ASC", ">")
        query = "SELECT id, filename, purpose, bytes, created_at FROM files WHERE 1 = 1"
        args: list[Any] = []
        if purpose is not None:
            query += " AND purpose = ?"
            args.append(purpose)
        if after is not None:
            query += f" AND seq {compare} (SELECT seq FROM files WHERE id = ?)"
            args.append(after)
        query += f" ORDER BY seq {order} LIMIT ?"
        args.append(limit + 1)
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        return [FileRecord(*row) for row in rows[:limit]], len(rows) > limit

    def path(self, file_id: str) -> Path:
        return self.dir / file_id

    def delete(self, file_id: str) -> bool:
        with self._lock, self._db:
            deleted = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        if deleted:
            self.path(file_id).unlink(missing_ok=True)
        return bool(deleted)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _remove_leftovers(self) -> None:
        """Bytes of uploads a crash interrupted, and of files whose record never committed."""
        with self._lock:
            known = {row[0] for row in self._db.execute("SELECT id FROM files")}
        for path in self.dir.iterdir():
            if path.suffix == ".partial" or path.name not in known:
                path.unlink(missing_ok=True)


def _sync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
