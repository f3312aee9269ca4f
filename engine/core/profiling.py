"""Step profiling on demand (vLLM's `--profiler-config`, `/start_profile`, `/stop_profile`):
what a profile records, and when it starts and stops, counted in engine steps.

The recording itself (torch's profiler, `engine/worker/profiler.py`) runs on the thread that runs
the steps, since torch's profiler sees only the thread that started it: `StepProfiler` is driven
from there, between steps. A profile starts `delay_iterations` steps after it is asked for and
stops when asked, or by itself after `max_iterations` steps; a stopped recording is saved off
that thread, so that the steps go on while its trace is written.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from engine.core.config_fields import check_fields

logger = logging.getLogger(__name__)

PROFILERS = ("torch",)


@dataclass(frozen=True, slots=True)
class ProfilerConfig:
    """vLLM's `--profiler-config` fields. `ignore_frontend` is taken for vLLM's command lines:
    the HTTP side is never traced here, only the engine's steps."""

    profiler: str | None = None
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    ignore_frontend: bool = False
    delay_iterations: int = 0
    max_iterations: int = 0

    def __post_init__(self) -> None:
        if self.profiler is not None and self.profiler not in PROFILERS:
            raise ValueError(
                f"unknown profiler {self.profiler!r}; this server records with "
                f"{', '.join(PROFILERS)}"
            )
        if self.profiler is not None and not self.torch_profiler_dir:
            raise ValueError("the torch profiler needs torch_profiler_dir, where traces go")
        for name in ("delay_iterations", "max_iterations"):
            if getattr(self, name) < 0:
                raise ValueError(f"profiler config field {name} must be 0 or more")

    @property
    def enabled(self) -> bool:
        return self.profiler is not None

    @property
    def folder(self) -> str:
        return os.path.abspath(os.path.expanduser(self.torch_profiler_dir))

    @classmethod
    def of(cls, fields: dict[str, Any]) -> ProfilerConfig:
        """The config a `--profiler-config` JSON object gives."""
        kinds: dict[str, tuple[type, ...]] = {name: (bool,) for name in cls.__dataclass_fields__}
        kinds |= {
            "profiler": (str, type(None)),
            "torch_profiler_dir": (str,),
            "delay_iterations": (int,),
            "max_iterations": (int,),
        }
        check_fields(fields, kinds, "profiler")
        return cls(**fields)


class Recording(Protocol):
    """A stopped recording: `save()` writes its files and returns their paths."""

    def save(self) -> list[str]: ...


class Recorder(Protocol):
    """What records one profile: started and stopped on the step thread."""

    def start(self) -> None: ...

    def stop(self) -> Recording: ...


class ProfilerStateError(Exception):
    """A start while a profile runs, or a stop while none does."""


class StepProfiler:
    """One profile at a time, started and stopped between steps. Every method runs on the step
    thread; what `stop` and `tick` return is saved elsewhere."""

    def __init__(self, config: ProfilerConfig, recorder: Callable[[], Recorder]) -> None:
        self.config = config
        self._new_recorder = recorder
        self._recorder: Recorder | None = None
        self._asked = False  # a profile was asked for and has not stopped
        self._delay = 0  # steps still to run before it starts recording
        self._steps = 0  # steps recorded

    @property
    def active(self) -> bool:
        return self._asked

    def start(self) -> None:
        if self._asked:
            raise ProfilerStateError("The profiler is already running; stop it first.")
        self._asked, self._delay, self._steps = True, self.config.delay_iterations, 0
        if self._delay == 0:
            self._begin()

    def stop(self) -> Recording | None:
        """End the profile: its recording, or None where it stopped before it began."""
        if not self._asked:
            raise ProfilerStateError("The profiler is not running; start it first.")
        return self._end()

    def tick(self) -> Recording | None:
        """After each step: begin a delayed profile, or end one that has recorded
        `max_iterations` steps (its recording, to save)."""
        if not self._asked:
            return None
        if self._recorder is None:
            self._delay -= 1
            if self._delay <= 0:
                try:
                    self._begin()
                except Exception:  # the steps go on unprofiled
                    logger.exception("the profiler failed to start")
                    self._asked = False
            return None
        self._steps += 1
        if self.config.max_iterations and self._steps >= self.config.max_iterations:
            return self._end()
        return None

    def _begin(self) -> None:
        recorder = self._new_recorder()
        recorder.start()
        self._recorder = recorder

    def _end(self) -> Recording | None:
        recorder, self._recorder, self._asked = self._recorder, None, False
        return None if recorder is None else recorder.stop()


def save_logged(recording: Recording) -> list[str]:
    """Save `recording` (on a thread of its own), saying where, or why it could not."""
    try:
        paths = recording.save()
    except Exception:
        logger.exception("the profile could not be saved")
        return []
    logger.info("profile saved: %s", ", ".join(paths))
    return paths


def save_in_background(recording: Recording) -> None:
    """Save `recording` on a thread of its own (one the interpreter waits for at exit, so that
    a trace is not cut short), while the steps go on."""
    threading.Thread(target=save_logged, args=(recording,), name="conveyor-trace").start()
