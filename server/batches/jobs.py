"""Batch jobs, durable: each batch and each of its lines in SQLite (WAL, next to the files), a
line's result committed as it finishes, so a restarted server knows which lines are still to run
and the output holds every `custom_id` exactly once.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.batches.state import open_db

SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    request TEXT NOT NULL,
    result TEXT,
    PRIMARY KEY (batch_id, line)
);
"""
# The stages whose time OpenAI's batch object records, by status.
STAGE_TIMES = {
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
    "expired": "expired_at",
}
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
WINDOW_SECONDS = 24 * 3600


@dataclass(slots=True)
class Batch:
    """OpenAI's batch object, as stored."""

    body: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.body["id"]

    @property
    def status(self) -> str:
        return self.body["status"]


def new_batch(input_file_id: str, endpoint: str, metadata: dict[str, str] | None) -> Batch:
    now = int(time.time())
    return Batch(
        {
            "id": f"batch_{uuid.uuid4().hex}",
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": "24h",
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + WINDOW_SECONDS,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
        }
    )


def _stamp(batch: Batch, status: str) -> None:
    """`status` and, for a stage, the time it was reached."""
    batch.body["status"] = status
    if status in STAGE_TIMES:
        batch.body[STAGE_TIMES[status]] = int(time.time())


class BatchStore:
    def __init__(self, state_dir: Path) -> None:
        self._lock = threading.Lock()
        self._db = open_db(state_dir, SCHEMA)

    def create(
        self, batch: Batch, lines: list[tuple[str, dict[str, Any]]], status: str = "validating"
    ) -> None:
        """The batch in `status` and its lines (custom_id, request body), in one transaction:
        a crash leaves the batch ready to run, or nothing."""
        batch.body["request_counts"]["total"] = len(lines)
        _stamp(batch, status)
        with self._lock, self._db:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            self._db.execute(
                "INSERT INTO batches VALUES (?, ?, ?)", (batch.id, seq, json.dumps(batch.body))
            )
            self._db.executemany(
                "INSERT INTO batch_lines VALUES (?, ?, ?, ?, NULL)",
                [(batch.id, i, cid, json.dumps(body)) for i, (cid, body) in enumerate(lines)],
            )

    def save(self, batch: Batch) -> None:
        with self._lock, self._db:
            self._db.execute(
                "UPDATE batches SET body = ? WHERE id = ?", (json.dumps(batch.body), batch.id)
            )

    def move(self, batch: Batch, status: str) -> None:
        """To `status`, stamping its stage time."""
        _stamp(batch, status)
        self.save(batch)

    def get(self, batch_id: str) -> Batch | None:
        with self._lock:
            row = self._db.execute("SELECT body FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return Batch(json.loads(row[0])) if row else None

    def page(self, limit: int, after: str | None) -> tuple[list[Batch], bool]:
        """Newest first, after the batch `after`; and whether more follow."""
        query = "SELECT body FROM batches"
        args: list[Any] = []
        if after is not None:
            query += " WHERE seq < (SELECT seq FROM batches WHERE id = ?)"
            args.append(after)
        query += " ORDER BY seq DESC LIMIT ?"
        args.append(limit + 1)
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        return [Batch(json.loads(r[0])) for r in rows[:limit]], len(rows) > limit

    def unfinished(self) -> list[Batch]:
        with self._lock:
            rows = self._db.execute("SELECT body FROM batches ORDER BY seq").fetchall()
        batches = [Batch(json.loads(r[0])) for r in rows]
        return [b for b in batches if b.status in UNFINISHED]

    def pending_lines(self, batch_id: str) -> list[tuple[int, str, dict[str, Any]]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT line, custom_id, request FROM batch_lines "
                "WHERE batch_id = ? AND result IS NULL ORDER BY line",
                (batch_id,),
            ).fetchall()
        return [(line, cid, json.loads(request)) for line, cid, request in rows]

    def finish_line(self, batch: Batch, line: int, result: dict[str, Any], ok: bool) -> None:
        """A line's result and the batch's counts, committed together. The count goes up under
        the lock: lines finish on several threads, and a count raised before it would reach the
        database in another line's commit, ahead of its own result (after a crash the line
        then runs again and counts twice)."""
        with self._lock, self._db:
            counts = batch.body["request_counts"]
            counts["completed" if ok else "failed"] += 1
            self._db.execute(
                "UPDATE batch_lines SET result = ? WHERE batch_id = ? AND line = ?",
                (json.dumps(result), batch.id, line),
            )
            self._db.execute(
                "UPDATE batches SET body = ? WHERE id = ?", (json.dumps(batch.body), batch.id)
            )

    def results(self, batch_id: str) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT result FROM batch_lines WHERE batch_id = ? AND result IS NOT NULL "
                "ORDER BY line",
                (batch_id,),
            ).fetchall()
        return [json.loads(r[0]) for r in rows]

    def totals(self) -> tuple[dict[str, int], dict[str, int]]:
        """Batches by status, and their lines: total, completed and failed."""
        with self._lock:
            rows = self._db.execute(
                "SELECT json_extract(body, '$.status'), COUNT(*), "
                "SUM(json_extract(body, '$.request_counts.total')), "
                "SUM(json_extract(body, '$.request_counts.completed')), "
                "SUM(json_extract(body, '$.request_counts.failed')) "
                "FROM batches GROUP BY 1"
            ).fetchall()
        statuses = {row[0]: row[1] for row in rows}
        unfinished = [row for row in rows if row[0] in UNFINISHED]
        lines = {
            "completed": sum(row[3] or 0 for row in rows),
            "failed": sum(row[4] or 0 for row in rows),
            "unfinished": sum((row[2] or 0) - (row[3] or 0) - (row[4] or 0) for row in unfinished),
        }
        return statuses, lines

    def close(self) -> None:
        with self._lock:
            self._db.close()
