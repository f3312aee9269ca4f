"""Attention backends behind one interface, chosen by name."""

from __future__ import annotations

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.torch_paged import TorchPagedAttention

_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchPagedAttention.name: TorchPagedAttention,
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> AttentionBackend:
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {available_backends()}"
        ) from None


__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends", "get_backend"]
