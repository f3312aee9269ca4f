"""What the kernel tests share."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import ops as cpu_ops


@pytest.fixture(autouse=True)
def _split(split_threads: int) -> None:
    """Every kernel test runs on two threads or more (`split_threads`)."""


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every layer run as one op, whether a layer at a time or the whole stack in one
    call (one entry per layer)."""
    seen: list[int] = []
    one_layer, all_layers = cpu_ops.decode_layer, cpu_ops.decode_layers

    def counting(hidden: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(hidden.shape[0])
        return one_layer(hidden, *args)

    def counting_stack(hidden: torch.Tensor, *args: object) -> torch.Tensor:
        keys = args[5]
        assert isinstance(keys, list)
        seen.extend([hidden.shape[0]] * len(keys))
        return all_layers(hidden, *args)

    monkeypatch.setattr(cpu_ops, "decode_layer", counting)
    monkeypatch.setattr(cpu_ops, "decode_layers", counting_stack)
    return seen
