"""Sends the prefix cache's events (`events.py`) over ZeroMQ in vLLM's wire format, so the
routers that read a vLLM replica's KV events read Conveyor's.

Each batch is one PUB message of three frames: the topic, the batch's sequence number (8 bytes,
big-endian, from 0) and the batch as MessagePack: `[ts, [event, ...], data_parallel_rank]`,
each event an array led by its type's name, `["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`
or `["AllBlocksCleared"]`. A subscriber that sees a gap in the numbers asks the replay socket (a
ROUTER) for every batch from a number on by sending it as 8 bytes; each kept batch comes back
as `[seq, payload]`, then `[-1, b""]` ends the replay.

A thread of its own encodes and sends, so a step only hands its events over; when the queue
is full a batch is dropped (its number is skipped, so subscribers see the gap) rather than
holding the engine up.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventsConfig

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# How long the thread waits for a batch before it looks at the replay socket again, and how
# long closing waits for the batches still queued.
POLL_SECONDS = 0.05
CLOSE_SECONDS = 1.0


def encode_batch(
    timestamp: float, events: list[KVEvent], medium: str, encode: Any, rank: int = 0
) -> bytes:
    """One batch in vLLM's array form (`encode`: a MessagePack encoder's `encode`; `rank`: the
    server's data-parallel rank)."""
    return encode([timestamp, [_event_fields(event, medium) for event in events], rank])


def _event_fields(event: KVEvent, medium: str) -> list[Any]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            event.block_hashes,
            event.parent_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            medium,
            event.lora_name,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, medium]
    assert isinstance(event, AllBlocksCleared)
    return ["AllBlocksCleared"]


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds the endpoint (a wildcard host, IPv6's `::`, ipc or
    inproc) or connects to a subscriber that bound it, as vLLM decides."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes event batches from a thread of its own. Create, `publish` each step's events,
    `close` once."""

    def __init__(self, config: KVEventsConfig, medium: str, rank: int = 0) -> None:
        """`rank`: the server's data-parallel rank, which its batches carry; `config` is the
        rank's own (`KVEventsConfig.for_rank`)."""
        zmq, msgspec = _libraries()
        self.config = config
        self.medium = medium
        self.rank = rank
        self._zmq = zmq
        self._encode = msgspec.msgpack.Encoder().encode
        context = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        opening = config.endpoint
        try:
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                opening = config.replay_endpoint
                self._replay = context.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            reason = zmq.strerror(exc.errno)
            raise ValueError(f"KV events: cannot open {opening}: {reason}") from None
        # Where the sockets listen, with a wildcard port resolved (`tcp://127.0.0.1:*`).
        self.endpoint: str = self._pub.last_endpoint.decode() or config.endpoint
        self.replay_endpoint: str | None = (
            self._replay.last_endpoint.decode() if self._replay is not None else None
        )
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, float, list[KVEvent]] | None] = queue.Queue(
            config.max_queue_size
        )
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="conveyor-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Hand a step's events to the sending thread; never blocks."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            if self.dropped == 0:
                logger.warning(
                    "KV events: the queue of %d batches is full; dropping batches (subscribers "
                    "see the gap in sequence numbers)",
                    self.config.max_queue_size,
                )
            self.dropped += 1

    def close(self) -> None:
        """Send what is queued (for up to a second), then stop."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=CLOSE_SECONDS)
        self._thread.join(CLOSE_SECONDS)
        if self._thread.is_alive():
            logger.warning("KV events: the sending thread did not stop; leaving it")
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=100)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ---- the sending thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if item is None:
                return
            try:
                self._send(*item)
            except Exception:
                logger.exception("KV events: a batch could not be sent")

    def _send(self, seq: int, timestamp: float, events: list[KVEvent]) -> None:
        payload = encode_batch(timestamp, events, self.medium, self._encode, self.rank)
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._sent.append((seq, payload))

    def _serve_replay(self) -> None:
        """Answer one replay request: every kept batch from the asked number on, then the end
        marker."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignored a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._sent):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))


def _libraries() -> tuple[Any, Any]:
    try:
        import msgspec
        import zmq
    except ImportError as exc:
        raise ValueError(
            f"--kv-events-config needs pyzmq and msgspec ({exc.name} is missing): "
            "pip install 'conveyor[kv-events]'"
        ) from None
    return zmq, msgspec
