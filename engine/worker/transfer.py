"""Moving small host values to the device and results back without draining the stream: a
blocking copy waits for every kernel queued before it, which would make the host wait for the
step in flight under async scheduling."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[bool],
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`torch.tensor(values, device=device)`, copied without waiting for the device."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class HostCopy:
    """Device tensors on their way to the host: into pinned memory without waiting, with an
    event recorded behind the copies (on a CPU the tensors themselves)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._event = None
        if any(t.is_cuda for t in tensors):
            tensors = [t.to("cpu", non_blocking=True) for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()
        self._tensors = tensors

    def wait(self) -> list[torch.Tensor]:
        """The tensors on the host, once their copies are done."""
        if self._event is not None:
            self._event.synchronize()
        return self._tensors
