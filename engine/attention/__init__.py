"""Attention backends behind one interface, chosen by name."""

from __future__ import annotations

import torch

from engine.attention import triton_paged
from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.cpu_paged import CpuPagedAttention
from engine.attention.in_place import InPlaceDecodeAttention
from engine.attention.torch_paged import TorchPagedAttention
from engine.attention.triton_paged import TritonPagedAttention
from engine.kernels.cpu import ops as cpu_ops

_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchPagedAttention.name: TorchPagedAttention,
    CpuPagedAttention.name: CpuPagedAttention,
    TritonPagedAttention.name: TritonPagedAttention,
}
AUTO = "auto"


def available_backends() -> list[str]:
    return [AUTO, *sorted(_BACKENDS)]


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`auto` is the Triton kernels on a GPU where they compile and run, the C++ kernel on a CPU
    where it builds, else pure torch."""
    if name != AUTO:
        return name
    if device.type == "cuda" and triton_paged.usable(str(device)):
        return TritonPagedAttention.name
    if device.type == "cpu" and cpu_ops.has("attention"):
        return CpuPagedAttention.name
    return TorchPagedAttention.name


def backend_class(name: str, device: torch.device) -> type[AttentionBackend]:
    """The class of the backend `name` resolves to on `device`."""
    resolved = resolve_backend_name(name, device)
    if resolved not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {resolved!r}; choose one of {available_backends()}"
        )
    return _BACKENDS[resolved]


def get_backend(
    name: str, device: torch.device | None = None, model_dtype: torch.dtype = torch.float32
) -> AttentionBackend:
    """The backend `name` asks for on `device`, for a model of `model_dtype` (the CPU kernel
    attends over a bf16 model's prompts in bf16 products)."""
    device = device or torch.device("cpu")
    name = resolve_backend_name(name, device)
    try:
        backend = _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {available_backends()}"
        ) from None
    if name == CpuPagedAttention.name and device.type != "cpu":
        raise ValueError(f"the {name!r} attention backend runs on the CPU only, not {device}")
    if name == TritonPagedAttention.name and not triton_paged.runs_on(device):
        raise ValueError(f"the {name!r} attention backend runs on CUDA devices, not {device}")
    if backend is CpuPagedAttention:
        return CpuPagedAttention(model_dtype)
    return backend()


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "InPlaceDecodeAttention",
    "available_backends",
    "backend_class",
    "get_backend",
    "resolve_backend_name",
]
