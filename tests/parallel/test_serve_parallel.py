"""`conveyor serve --tensor-parallel-size 2` as a user runs it: it serves, says its parallel size,
turns unhealthy with the rank named when a worker dies, and leaves no process behind whether it
is stopped with SIGTERM or killed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.server_utils import server_process

pytestmark = pytest.mark.e2e


def serve(folder: Path, own_group: bool = False) -> tuple[subprocess.Popen, str]:
    """The server on a free port; `own_group`: in a process group of its own, as a terminal
    starts it (Ctrl-C signals the whole group)."""
    options = ["--model", str(folder), "--served-model-name", "tiny", "--dtype", "float32"]
    options += ["--kv-cache-memory", "16MiB", "--tensor-parallel-size", "2"]
    return server_process(*options, own_group=own_group)


def children(pid: int) -> set[int]:
    """The process's direct children (Linux's /proc)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found.update(int(child) for child in (task / "children").read_text().split())
    return found


def descendants(pid: int) -> set[int]:
    """The process's children, theirs, and so on."""
    found = children(pid)
    for child in list(found):
        found |= descendants(child)
    return found


def worker_pid(pid: int) -> int:
    """Rank 1: a CPU worker is forked by the server's fork server, a child of the server."""
    for child in children(pid):
        if "forkserver" in Path(f"/proc/{child}/cmdline").read_text():
            (worker,) = children(child)
            return worker
    raise AssertionError("no fork server")


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def gone_within(pids: set[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def complete(url: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_a_dead_worker_turns_the_server_unhealthy_and_sigterm_leaves_nothing(model_dir):
    process, url = serve(model_dir)
    try:
        assert complete(url).json()["usage"]["completion_tokens"] == 5
        metrics = httpx.get(f"{url}/metrics").text
        assert 'conveyor:parallel_config_info{engine="0",' in metrics
        assert 'tensor_parallel_size="2"} 1.0' in metrics
        assert httpx.get(f"{url}/get_server_info").json()["tensor_parallel_size"] == 2
        ours = descendants(process.pid)
        os.kill(worker_pid(process.pid), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").status_code == 200:
            assert time.monotonic() < deadline, "still healthy without its worker"
            time.sleep(0.1)
        refused = complete(url)
        assert refused.status_code == 503
        assert "rank 1 exited with code -9" in refused.json()["error"]["message"]
    finally:
        process.send_signal(signal.SIGTERM)
        log = process.communicate(timeout=60)[0]
    assert process.returncode == 0, log
    assert "tensor parallel 2" in log and "rank 1 exited" in log
    assert gone_within(ours, 10), "a child process outlived the server"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_workers_exit_when_the_server_is_killed(model_dir):
    process, _ = serve(model_dir)
    worker = worker_pid(process.pid)
    process.kill()
    process.communicate(timeout=60)
    assert gone_within({worker}, 15), "the worker outlived a killed server"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_ctrl_c_stops_every_rank(model_dir):
    process, url = serve(model_dir, own_group=True)
    ours = descendants(process.pid)
    assert complete(url).status_code == 200
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
    log = process.communicate(timeout=60)[0]
    assert process.returncode == 0, log
    assert gone_within(ours, 10), "a child process outlived the server"
