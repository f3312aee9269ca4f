"""The LoRA adapters a server knows by name. Imports no torch: the core and the server read it.

A request names an adapter by its `model` field; the engine keeps the `LoRARequest` the name
resolved to for the request's whole life, so an adapter removed meanwhile still serves the
requests that named it before."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """One loaded adapter: the name requests give, the id its weights are kept under (unique for
    the server's life: an adapter loaded again under the same name gets a new one), its folder."""

    name: str
    lora_id: int
    path: str

    @property
    def hash_root(self) -> bytes:
        """The parent hash of a sequence's first KV block under this adapter: the same tokens
        give other keys and values through other weights, so they never share a cached block
        with the base model's or another adapter's."""
        return hashlib.sha256(f"lora:{self.lora_id}:{self.name}".encode()).digest()


@dataclass(slots=True)
class LoRARegistry:
    """Adapter names to the loaded adapters."""

    adapters: dict[str, LoRARequest] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def new_request(self, name: str, path: str) -> LoRARequest:
        """A fresh id for an adapter about to load (`add` makes it known once it has)."""
        return LoRARequest(name, next(self._ids), path)

    def add(self, lora: LoRARequest) -> None:
        self.adapters[lora.name] = lora

    def remove(self, name: str) -> LoRARequest | None:
        return self.adapters.pop(name, None)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self.adapters
