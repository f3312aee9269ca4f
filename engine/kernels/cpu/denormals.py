"""Subnormal floats flushed to zero on the threads that compute a CPU step.

x86 cores take a slow path for each arithmetic op that reads or makes a subnormal float (below
fp32's smallest normal number, 1.2e-38). A model makes them where factors decay: a Gated DeltaNet's
decays over a chunk of tokens reach far below it, and its chunked products over them ran more than
twice as slowly as over zeros (Qwen3.5's prompts: a 2048-token prefill step of a small Qwen3.5 took
7.2 s with them, 4.5 s flushed). What they change in a step's numbers is below 1e-38, far under
fp32's resolution of any sum they enter. The mode (FTZ and DAZ) belongs to each thread, so the
thread that runs steps sets it on itself and on its team for torch's parallel ops once, before its
first step; threads started later copy it from their starter. TensorFlow's thread pools and
oneDNN-based CPU servers run so by default.
"""

from __future__ import annotations

import logging
import threading

import torch

from engine.kernels.cpu import ops as cpu_ops

logger = logging.getLogger(__name__)

_flushed = threading.local()


def flush_on_this_thread() -> None:
    """Flush subnormals on this thread and its team, once per thread: Conveyor's op where the
    kernels built, else torch's switch, which reaches this thread alone."""
    if getattr(_flushed, "done", False):
        return
    _flushed.done = True
    if cpu_ops.has("elementwise"):
        threads = int(torch.ops.conveyor.flush_denormals(True))
    else:
        threads = int(torch.set_flush_denormal(True))
    logger.debug("subnormal floats flushed to zero on %d threads", threads)
