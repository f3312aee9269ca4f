"""The batch store's commits: whatever a crash leaves on disk, the counts agree with the line
results committed."""

from __future__ import annotations

import json
import sqlite3
import sys
import threading

import pytest

from server.batches.jobs import BatchStore, new_batch
from server.batches.state import STATE_DB


@pytest.fixture
def fast_switching():
    """Threads switch every microsecond, so that races show."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def test_every_commit_counts_exactly_the_results_it_holds(tmp_path, fast_switching):
    store = BatchStore(tmp_path)
    batch = new_batch("file-1", "/v1/completions", None)
    lines = 400
    store.create(batch, [(f"c{i}", {"prompt": "x"}) for i in range(lines)])
    reader = sqlite3.connect(tmp_path / STATE_DB, check_same_thread=False)
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            # One statement: one snapshot of both.
            body, results = reader.execute(
                "SELECT body, (SELECT COUNT(*) FROM batch_lines WHERE result IS NOT NULL) "
                "FROM batches"
            ).fetchone()
            counts = json.loads(body)["request_counts"]
            seen.append((counts["completed"] + counts["failed"], results))

    def finish(first: int) -> None:
        for line in range(first, lines, 8):
            store.finish_line(batch, line, {"custom_id": f"c{line}"}, ok=line % 5 != 0)

    watcher = threading.Thread(target=read)
    watcher.start()
    workers = [threading.Thread(target=finish, args=(k,)) for k in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    done.set()
    watcher.join()
    assert len(seen) > 10
    assert all(counted == committed for counted, committed in seen), [
        pair for pair in seen if pair[0] != pair[1]
    ][:5]
    assert batch.body["request_counts"] == {"total": lines, "completed": 320, "failed": 80}
