"""The worker processes of ranks 1..N-1, and rank 0's handle on them.

Rank 0 (the engine's step thread) sends each step to every worker as one pickled `StepInputs`
over a pipe; the workers run their share of the forward pass and meet rank 0 in the model's
collectives. The pipes also carry start-up news ("ready", or an error), and a worker whose pipe
closes (rank 0 is gone) exits, as does one whose parent process changes: no orphans.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

import torch

from engine.core.config import EngineConfig
from engine.core.errors import WorkerFailedError
from engine.core.profiling import save_in_background
from engine.parallel.group import ParallelGroup, connect, host_store, join_store
from engine.parallel.step import StepInputs

logger = logging.getLogger(__name__)

T = TypeVar("T")
READY, ERROR = "ready", "error"
# How often a waiting rank 0 looks at its workers, and a worker at its parent.
POLL_SECONDS = 0.1
PARENT_POLL_SECONDS = 1.0
JOIN_SECONDS = 10.0
# How long rank 0 waits, after a collective or a pipe failed, for a dead worker to show.
SETTLE_SECONDS = 2.0


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: CUDA devices in order from the one asked for; the CPU is shared."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def split_threads(size: int) -> int:
    """On the CPU, each rank takes its share of the cores; returns the threads it had."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, before // size))
    return before


class WorkerPool:
    """Ranks 1..N-1 as seen from rank 0: start them, send them steps, watch them, stop them."""

    def __init__(self, processes: list[Any], pipes: list[Connection]) -> None:
        self.processes = processes
        self.pipes = pipes
        self.group = ParallelGroup()
        self._errors: dict[int, str] = {}
        self._closing = False
        # A step failed across the ranks: a worker may sit in a collective that will not end.
        self._broken = False
        self._store: Any = None
        self._threads = torch.get_num_threads()

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> WorkerPool:
        """Spawn the workers and join them in one group (rank 0 here)."""
        size = config.tensor_parallel_size
        store, port = host_store(size)
        context = worker_context(device)
        processes, pipes = [], []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=run_worker,
                args=(config, rank, port, theirs, logging.getLogger().level, dict(os.environ)),
                name=f"conveyor-rank-{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            processes.append(process)
            pipes.append(ours)
        pool = cls(processes, pipes)
        pool._store = store
        logger.info("tensor parallel: started %d worker processes", size - 1)
        try:
            pool.group = pool.watched(lambda: connect(store, 0, size, rank_device(device, 0)))
        except BaseException:
            pool.close()
            raise
        pool._threads = split_threads(size)
        return pool

    @property
    def size(self) -> int:
        return len(self.processes) + 1

    # ---- start-up ---------------------------------------------------------------------------

    def watched(self, work: Callable[[], T]) -> T:
        """`work()` on a helper thread, given up on if a worker dies first (a collective whose
        peer never joined waits for the store's timeout otherwise)."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = work()
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=run, name="conveyor-rank-0-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(POLL_SECONDS)
            failure = self.failure() if thread.is_alive() else ""
            if failure:
                raise WorkerFailedError(failure)
        if "error" in box:
            raise box["error"]
        return box["value"]

    def wait_ready(self) -> None:
        """Until every worker says it is ready; raises with the first one's error otherwise."""
        for rank, pipe in enumerate(self.pipes, start=1):
            while not pipe.poll(POLL_SECONDS):
                if not self.processes[rank - 1].is_alive():
                    raise WorkerFailedError(self.failure())
            kind, text = pipe.recv()
            if kind != READY:
                self._errors[rank] = text
                raise WorkerFailedError(self.failure())
        logger.info("tensor parallel: %d ranks ready", self.size)

    # ---- steps ------------------------------------------------------------------------------

    def send(self, step: StepInputs) -> None:
        """Hand the step to every worker (pickled once)."""
        self._send_all(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))

    def tell_profilers(self, command: str) -> None:
        """Have every worker `"start"` or `"stop"` (and save) its profile between two steps,
        as rank 0 does its own."""
        self._send_all(pickle.dumps(command))

    def _send_all(self, data: bytes) -> None:
        try:
            for pipe in self.pipes:
                pipe.send_bytes(data)
        except OSError as exc:
            reason = self.why_failed() or f"a worker's pipe closed: {exc}"
            raise WorkerFailedError(reason) from exc

    def failure(self, settle: float = 0.0) -> str:
        """What went wrong with the workers ("" while every one runs). `settle`: seconds to
        wait for a worker's exit to show, after a collective failed because its connection
        closed (a dying process closes its sockets a moment before it can be reaped)."""
        deadline = time.monotonic() + settle
        while True:
            found = self._problems()
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(POLL_SECONDS / 5)

    def why_failed(self) -> str:
        """`failure()` once a dead worker has had time to show, after a collective or a pipe
        failed."""
        self._broken = True
        return self.failure(SETTLE_SECONDS)

    def _problems(self) -> str:
        problems = []
        for rank, process in enumerate(self.processes, start=1):
            self._read_error(rank)
            if process.is_alive() and rank not in self._errors:
                continue
            problem = f"tensor-parallel rank {rank}"
            if not process.is_alive():
                problem += f" exited with code {process.exitcode}"
            if rank in self._errors:
                problem += f": {self._errors[rank]}"
            problems.append(problem)
        return "; ".join(problems)

    def _read_error(self, rank: int) -> None:
        pipe = self.pipes[rank - 1]
        try:
            while pipe.poll():
                kind, text = pipe.recv()
                if kind == ERROR:
                    self._errors[rank] = text
        except (EOFError, OSError):
            pass

    def watch(self, on_failure: Callable[[WorkerFailedError], None]) -> None:
        """Call `on_failure` (from a thread of its own) when a worker exits before `close()`."""

        def run() -> None:
            sentinels = [process.sentinel for process in self.processes]
            while not self._closing:
                ended = wait(sentinels, timeout=POLL_SECONDS * 5)
                if ended and not self._closing:
                    for process in self.processes:
                        if process.sentinel in ended:
                            process.join(JOIN_SECONDS)  # its exit code, once reaped
                    # Another thread may be reaping it at the same moment (its exit then shows
                    # to this one a poll later): wait for it to show.
                    reason = self.failure(SETTLE_SECONDS) or "a tensor-parallel worker exited"
                    error = WorkerFailedError(reason)
                    logger.error("the engine stops: %s", error)
                    on_failure(error)
                    return

        threading.Thread(target=run, name="conveyor-rank-watch", daemon=True).start()

    # ---- shutdown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every worker: asked first, then terminated, then killed."""
        self._closing = True
        stop = pickle.dumps(None)
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send_bytes(stop)
        # After a failed step a worker may wait in a collective for good: no polite wait.
        deadline = time.monotonic() + (POLL_SECONDS if self._broken else JOIN_SECONDS)
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                if not self._broken:
                    logger.warning("tensor-parallel %s did not stop; terminating it", process.name)
                process.terminate()
                process.join(2)
            if process.is_alive():
                process.kill()
                process.join()
        for pipe in self.pipes:
            pipe.close()
        self.group = ParallelGroup()
        self._store = None
        torch.set_num_threads(self._threads)


# ---- the worker side ------------------------------------------------------------------------


# What a CPU worker imports before it is forked: the engine, and torch with it.
PRELOADED = ["engine.factory", "engine.worker.model_runner"]


def worker_context(device: torch.device) -> Any:
    """How workers start. On the CPU, forked from a server process that imported the engine
    once (`forkserver`): a worker is up in a moment, where a fresh interpreter takes seconds
    to import torch and the engine again. A CUDA worker starts in a fresh interpreter
    (`spawn`), so that no CUDA state is ever inherited through a fork."""
    if device.type == "cuda":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    return context


def run_worker(
    config: EngineConfig,
    rank: int,
    port: int,
    pipe: Connection,
    log_level: int,
    environment: dict[str, str],
) -> None:
    """A worker process: join the group, load this rank's share, then run steps until told to
    stop or rank 0 goes away. `environment`: rank 0's, as it is now (a forked worker would
    otherwise see its server's, as it was when the server started)."""
    os.environ.clear()
    os.environ.update(environment)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    logging.basicConfig(
        level=log_level or logging.INFO,
        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s",
        force=True,
    )
    _exit_with_parent()
    try:
        steps = _start(config, rank, port)
        pipe.send((READY, ""))
    except BaseException as exc:
        logger.exception("rank %d failed to start", rank)
        _report(pipe, exc)
        raise SystemExit(1) from None
    try:
        _serve(pipe, steps, _rank_profiler(config, rank))
    except BaseException as exc:
        logger.exception("rank %d failed a step", rank)
        _report(pipe, exc)
        raise SystemExit(1) from None


def _start(config: EngineConfig, rank: int, port: int) -> Callable[[StepInputs], None]:
    from engine.factory import build_rank, load_rank
    from engine.kernels.cpu import denormals
    from engine.loading.model_loader import resolve_device
    from engine.parallel.sharding import Shard
    from engine.worker.model_runner import (
        model_inputs,
        placed_input_ids,
        restore_states,
        save_states,
    )

    size = config.tensor_parallel_size
    device = rank_device(resolve_device(config.device), rank)
    group = connect(join_store(port, size), rank, size, device)
    split_threads(size)
    loaded, dtype = load_rank(config, device, group)
    assert loaded.shard is not None
    parts = build_rank(loaded, config, device, dtype, Shard(group, loaded.shard))
    model, backend, kv_cache = parts.model, parts.backend, parts.kv_cache
    kv_cache.calibrating = parts.calibrates
    no_tokens = torch.zeros(0, dtype=torch.int64, device=device)

    @torch.inference_mode()
    def step(inputs: StepInputs) -> None:
        if device.type == "cpu":
            denormals.flush_on_this_thread()
        kv_cache.copy_blocks(inputs.block_copies)
        restore_states(kv_cache, inputs.state_copies)
        previous = no_tokens
        if len(inputs.previous_rows):  # async scheduling: rank 0's last tokens, on the device
            previous = torch.empty(inputs.previous_count, dtype=torch.int64, device=device)
            group.broadcast(previous)
        input_ids = placed_input_ids(inputs.batch, previous, inputs.previous_rows, device)
        model(*model_inputs(backend, kv_cache, inputs.batch, inputs.logits_indices, input_ids))
        kv_cache.end_calibration()
        save_states(kv_cache, inputs.state_copies)

    return step


def _serve(
    pipe: Connection, step: Callable[[StepInputs], None], profile: Callable[[str], None]
) -> None:
    while True:
        try:
            inputs = pickle.loads(pipe.recv_bytes())
        except EOFError:
            logger.info("rank 0 has gone; stopping")
            return
        if inputs is None:
            return
        if isinstance(inputs, str):
            profile(inputs)
        else:
            step(inputs)


def _rank_profiler(config: EngineConfig, rank: int) -> Callable[[str], None]:
    """What starts and stops this rank's profile when rank 0 says so; a stopped profile is
    saved on a thread of its own while the steps go on."""
    from engine.loading.model_loader import resolve_device
    from engine.worker.profiler import TorchRecorder

    recorder: TorchRecorder | None = None

    def profile(command: str) -> None:
        nonlocal recorder
        if config.profiler is None:
            return
        if command == "start":
            device = rank_device(resolve_device(config.device), rank)
            recorder = TorchRecorder(config.profiler, device, rank)
            recorder.start()
        elif command == "stop" and recorder is not None:
            recording, recorder = recorder.stop(), None
            save_in_background(recording)

    return profile


def _report(pipe: Connection, exc: BaseException) -> None:
    with contextlib.suppress(OSError):
        pipe.send((ERROR, f"{type(exc).__name__}: {exc}"))


def _exit_with_parent() -> None:
    """Exit when the process that started this one is gone, whatever this one is doing (a
    forked worker's parent is its fork server, which exits with rank 0)."""
    parent = os.getppid()

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=run, name="conveyor-parent-watch", daemon=True).start()
