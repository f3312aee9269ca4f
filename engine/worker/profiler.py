"""Records a profile with torch's profiler (`engine/core/profiling.py` says when): the step
thread's operators, and the GPU's kernels on CUDA, saved as a Chrome trace (Perfetto and
`chrome://tracing` open it) and a table of the operators that took the most time."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from engine.core.profiling import ProfilerConfig

# Rows of the summary table, by self time.
SUMMARY_ROWS = 50


class TorchRecorder:
    """One profile of this process's step thread; `tell_ranks` (rank 0 under tensor
    parallelism) has the other ranks start and stop theirs at the same steps."""

    def __init__(
        self,
        config: ProfilerConfig,
        device: torch.device,
        rank: int = 0,
        tell_ranks: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.rank = rank
        self.tell_ranks = tell_ranks
        self._profile: profile | None = None

    def start(self) -> None:
        os.makedirs(self.config.folder, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        config = self.config
        recording = profile(
            activities=activities,
            record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory,
            with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops,
        )
        if self.tell_ranks is not None:
            self.tell_ranks("start")
        recording.start()
        self._profile = recording

    def stop(self) -> TorchRecording:
        assert self._profile is not None, "stopped before it started"
        recording, self._profile = self._profile, None
        recording.stop()
        if self.tell_ranks is not None:
            self.tell_ranks("stop")
        return TorchRecording(recording, self.config, self.device, self.rank)


class TorchRecording:
    def __init__(
        self, recording: profile, config: ProfilerConfig, device: torch.device, rank: int
    ) -> None:
        self.recording = recording
        self.config = config
        self.device = device
        self.rank = rank

    def save(self) -> list[str]:
        """Write the trace and the summary; their paths."""
        stem = os.path.join(
            self.config.folder, f"conveyor-{socket.gethostname()}-rank{self.rank}.{time.time_ns()}"
        )
        trace = f"{stem}.pt.trace.json" + (".gz" if self.config.torch_profiler_use_gzip else "")
        self.recording.export_chrome_trace(trace)
        summary = f"{stem}.summary.txt"
        cuda_time = self.device.type == "cuda" and self.config.torch_profiler_dump_cuda_time_total
        order = "self_cuda_time_total" if cuda_time else "self_cpu_time_total"
        table = self.recording.key_averages().table(sort_by=order, row_limit=SUMMARY_ROWS)
        with open(summary, "w") as file:
            file.write(table + "\n")
        return [trace, summary]
