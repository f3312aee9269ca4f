"""KV cache events: what the prefix cache stores and forgets, for routers outside the server
that route each request to the replica already holding its prefix (vLLM's KV events, which
llm-d's precise prefix-cache scorer, Dynamo's KV router and AIBrix read).

The block manager records an event when a full block is published to the prefix cache
(`BlockStored`, with its tokens, so a router can key it by content), when a cached block is
evicted or forgotten (`BlockRemoved`), and when a reset leaves nothing cached
(`AllBlocksCleared`). The engine publishes each step's events as one batch
(`event_publisher.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from engine.core.config_fields import check_fields

# vLLM's `--kv-events-config` fields and their defaults.
DEFAULT_ENDPOINT = "tcp://*:5557"
PUBLISHERS = ("null", "zmq")


def external_hash(block_hash: bytes) -> int:
    """A block's hash as events carry it: the last 8 bytes of its SHA-256, as an unsigned
    big-endian integer (vLLM's default form, which routers read as uint64)."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(slots=True)
class BlockStored:
    """Full blocks published in order, each the child of the one before; the first one's
    parent is `parent_hash` (None: the first block of a sequence)."""

    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventSink(Protocol):
    """Where the engine sends each step's events (`event_publisher.ZmqEventPublisher`)."""

    def publish(self, events: list[KVEvent]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config`: publish the prefix cache's events over ZeroMQ, each step's
    as one batch on a PUB socket at `endpoint` (bound when it has a wildcard host, `::`, or is
    `ipc://` / `inproc://`; else connected), prefixed with `topic` and a sequence number; the
    last `buffer_steps` batches are resent on request at `replay_endpoint` (a ROUTER socket)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"unknown KV events publisher {self.publisher!r}; choose one of "
                f"{', '.join(PUBLISHERS)}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KV events config field {name} must be at least 1")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"KV events endpoint {self.endpoint!r} is not a ZeroMQ address")

    def for_rank(self, rank: int) -> KVEventsConfig:
        """The config of data-parallel rank `rank` (one of several servers behind a router):
        its sockets at the endpoints' ports plus the rank, or with `_dp{rank}` after an
        `ipc://` or `inproc://` address, as vLLM's ranks open theirs."""
        if rank == 0:
            return self
        replay = self.replay_endpoint
        return replace(
            self,
            endpoint=rank_endpoint(self.endpoint, rank),
            replay_endpoint=None if replay is None else rank_endpoint(replay, rank),
        )

    @property
    def publishes(self) -> bool:
        """Whether events are recorded and sent anywhere."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def of(cls, fields: dict[str, Any]) -> KVEventsConfig:
        """The config a `--kv-events-config` JSON object gives; the publisher is `zmq` unless
        named, as in vLLM where events are on."""
        kinds: dict[str, tuple[type, ...]] = {
            "enable_kv_cache_events": (bool,),
            "publisher": (str,),
            "endpoint": (str,),
            "replay_endpoint": (str, type(None)),
            "buffer_steps": (int,),
            "hwm": (int,),
            "max_queue_size": (int,),
            "topic": (str,),
        }
        check_fields(fields, kinds, "KV events")
        return cls(**fields)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """`endpoint` for data-parallel rank `rank`: a TCP port plus the rank (a wildcard port stays
    one), an `ipc://` or `inproc://` name with `_dp{rank}` after it."""
    if rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{rank}"
    host, colon, port = endpoint.rpartition(":")
    if not colon or host == "tcp" or port == "*":
        return endpoint
    if not port.isdigit() or int(port) + rank > 65535:
        raise ValueError(f"KV events endpoint {endpoint!r} has no port for rank {rank}")
    return f"{host}:{int(port) + rank}"


@dataclass(slots=True)
class EventLog:
    """The events recorded since the engine last took them."""

    events: list[KVEvent] = field(default_factory=list)

    def stored(self, event: BlockStored) -> None:
        self.events.append(event)

    def removed(self, block_hash: int) -> None:
        """One more block forgotten: joins the last event if that removed blocks too."""
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
