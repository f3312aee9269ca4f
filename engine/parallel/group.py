"""The ranks of one tensor-parallel model and the collectives its layers need.

The group is built from its own store rather than torch's global default group, so one process
can hold several engines (tests do) and a group ends with its engine. gloo runs on the CPU and
NCCL on CUDA; the layers call the same three methods whichever runs.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# How long a collective waits for the other ranks. Steps take milliseconds to seconds; a rank
# that dies closes its connections and the others fail at once, so this only bounds a hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
STORE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(slots=True)
class ParallelGroup:
    """Rank `rank` of `size` ranks. `size == 1` needs no process group and reduces nothing."""

    rank: int = 0
    size: int = 1
    process_group: Any = None

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        if self.is_parallel:
            self.process_group.allreduce([tensor]).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` on every rank, in place; returns it."""
        if self.is_parallel:
            self.process_group.broadcast([tensor]).wait()
        return tensor

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' `value`s."""
        if not self.is_parallel:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        return int(self._reduce(tensor, dist.ReduceOp.MIN).item())

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' largest entries of `tensor`, in place; returns it."""
        return self._reduce(tensor, dist.ReduceOp.MAX) if self.is_parallel else tensor

    def _reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self.process_group.allreduce([tensor], options).wait()
        return tensor

    def all_gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' `[rows, cols]` tensors side by side: `[rows, size * cols]`, rank order."""
        if not self.is_parallel:
            return tensor
        tensor = tensor.contiguous()
        rows, cols = tensor.shape
        gathered = torch.empty((self.size * rows, cols), dtype=tensor.dtype, device=tensor.device)
        self.process_group._allgather_base(gathered, tensor).wait()
        # (A step that samples no row, a prompt's chunk, gathers none.)
        return gathered.view(self.size, rows, cols).permute(1, 0, 2).reshape(rows, self.size * cols)


def host_store(size: int) -> tuple[Any, int]:
    """Rank 0's rendezvous store on a free local port, and the port for the other ranks."""
    store = dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False
    )
    return store, store.port


def join_store(port: int, size: int) -> Any:
    return dist.TCPStore(
        "127.0.0.1", port, size, is_master=False, timeout=STORE_TIMEOUT, wait_for_workers=False
    )


def connect(store: Any, rank: int, size: int, device: torch.device) -> ParallelGroup:
    """Join the group (blocks until every rank has joined): NCCL on CUDA, gloo on the CPU."""
    if device.type == "cuda":
        # NCCL builds its communicator on the calling thread's current device.
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        group: Any = dist.ProcessGroupNCCL(store, rank, size, options)
        # NCCL needs a communicator on the device before the first collective.
        group.allreduce([torch.zeros(1, device=device)]).wait()
    else:
        group = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
    return ParallelGroup(rank, size, group)
