"""KV events on the wire (`engine/kv/event_publisher.py`): vLLM's three-frame messages over
ZeroMQ, read back with a decoder of vLLM's event types as its subscribers declare them; the
replay socket; batches dropped as gaps; and a served model's cache seen through them."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.kv.event_publisher import END_OF_REPLAY, ZmqEventPublisher, binds
from engine.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventLog,
    KVEventsConfig,
    external_hash,
)
from server.cli import build_parser, engine_config
from tests.helpers import chat_tokenizer, run_all, tiny_llama
from tests.server_utils import app_client, wait_until_idle


# vLLM's event types as a subscriber declares them (arrays, each event led by its type name).
class VllmEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VllmAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(VllmBatch)
LOCAL = "tcp://127.0.0.1:*"


def publisher(rank: int = 0, **fields: object) -> ZmqEventPublisher:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=LOCAL, **fields)  # type: ignore[arg-type]
    return ZmqEventPublisher(config, "CPU", rank)


def subscribed(endpoint: str, topic: str, probe: ZmqEventPublisher) -> tuple[zmq.Socket, int]:
    """A SUB socket that receives the publisher's next batches: probes (empty batches) are
    published until one arrives (a subscription takes a moment to reach the publisher)."""
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
    socket.connect(endpoint)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        probe.publish([])
        if socket.poll(100):
            _, seq, _ = socket.recv_multipart()
            while socket.poll(200):  # later probes already on their way
                _, seq, _ = socket.recv_multipart()
            return socket, int.from_bytes(seq, "big")
    raise AssertionError("no batch reached the subscriber")


def replayed(endpoint: str, first: int) -> list[tuple[int, VllmBatch]]:
    """Every kept batch from `first` on, asked of the replay socket as a DEALER asks."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.connect(endpoint)
    try:
        socket.send_multipart([b"", first.to_bytes(8, "big")])
        batches: list[tuple[int, VllmBatch]] = []
        while True:
            assert socket.poll(30_000), "the replay did not answer"
            empty, seq, payload = socket.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY:
                assert payload == b""
                return batches
            batches.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    finally:
        socket.close(linger=0)


def test_batches_arrive_in_vllms_three_frames_and_decode_as_vllms_types():
    events = [
        BlockStored([11, 2**64 - 1], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, 3, "sql"),
        BlockRemoved([11]),
        AllBlocksCleared(),
    ]
    sender = publisher(topic="kv@pod-a@tiny")
    try:
        socket, last = subscribed(sender.endpoint, "kv@pod-a@tiny", sender)
        before = time.time()
        sender.publish(events)
        assert socket.poll(30_000)
        topic, seq, payload = socket.recv_multipart()
        socket.close(linger=0)
    finally:
        sender.close()
    assert topic == b"kv@pod-a@tiny" and int.from_bytes(seq, "big") == last + 1
    batch = DECODER.decode(payload)
    assert before - 1 <= batch.ts <= time.time() and batch.data_parallel_rank == 0
    assert batch.events == [
        VllmBlockStored([11, 2**64 - 1], None, list(range(1, 9)), 4, 3, "CPU", "sql"),
        VllmBlockRemoved([11], "CPU"),
        VllmAllBlocksCleared(),
    ]


def test_the_replay_socket_resends_kept_batches_from_a_number_on():
    sender = publisher(replay_endpoint=LOCAL, buffer_steps=3)
    assert sender.replay_endpoint is not None
    try:
        for index in range(5):
            sender.publish([BlockRemoved([index])])
        deadline = time.monotonic() + 30
        while len(sender._sent) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        batches = replayed(sender.replay_endpoint, 1)
    finally:
        sender.close()
    # Only the last three were kept; each comes back with its number.
    assert [seq for seq, _ in batches] == [2, 3, 4]
    assert [batch.events for _, batch in batches] == [
        [VllmBlockRemoved([index], "CPU")] for index in (2, 3, 4)
    ]


def test_a_full_queue_drops_batches_as_a_gap_in_the_numbers():
    sender = publisher(replay_endpoint=LOCAL, max_queue_size=1)
    held = threading.Event()
    sending = threading.Event()
    send = sender._send

    def slow_send(*args: object) -> None:
        sending.set()
        held.wait(30)
        send(*args)  # type: ignore[arg-type]

    sender._send = slow_send  # type: ignore[method-assign]
    try:
        sender.publish([BlockRemoved([0])])  # taken by the thread, which then waits
        assert sending.wait(30)
        sender.publish([BlockRemoved([1])])  # fills the queue
        sender.publish([BlockRemoved([2])])  # dropped
        assert sender.dropped == 1
        held.set()
        sender._send = send  # type: ignore[method-assign]
        deadline = time.monotonic() + 30
        while not sender._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        sender.publish([BlockRemoved([3])])
        while len(sender._sent) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sender.replay_endpoint is not None
        numbers = [seq for seq, _ in replayed(sender.replay_endpoint, 0)]
    finally:
        held.set()
        sender.close()
    assert numbers == [0, 1, 3]


def test_a_taken_port_is_refused_with_the_address():
    first = publisher()
    taken = "tcp://*:" + first.endpoint.rsplit(":", 1)[1]
    try:
        message = f"KV events: cannot open {re.escape(taken)}: Address already in use$"
        with pytest.raises(ValueError, match=message):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=taken), "CPU")
    finally:
        first.close()


def test_wildcards_ipc_and_inproc_bind_and_named_hosts_connect():
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/kv")
    assert binds("inproc://kv") and not binds("tcp://router.local:5557")


def test_a_served_models_cache_is_seen_through_its_events(tmp_path: Path):
    """`conveyor serve --kv-events-config`: the factory opens the publisher before the model
    loads; requests sharing a prompt prefix store its blocks once, under the tokens the
    prompt has, and a reset clears them."""
    tiny_llama().save_pretrained(tmp_path)
    chat_tokenizer().save_pretrained(tmp_path)
    events = {"enable_kv_cache_events": True, "endpoint": LOCAL, "replay_endpoint": LOCAL}
    argv = ["serve", "--model", str(tmp_path), "--num-blocks", "64", "--block-size", "4"]
    argv += ["--dtype", "float32", "--kv-events-config", json.dumps(events)]
    core, _, _ = create_engine_core(engine_config(build_parser().parse_args(argv)))
    try:
        assert core.kv_events is not None
        shared = list(range(20, 32))
        prompts = [[*shared, 40, 41], [*shared, 50, 51, 52, 53, 54]]
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        run_all(core, prompts[:1], params)
        run_all(core, prompts[1:], params)
        core.scheduler.block_manager.reset_cache()
        core.publish_kv_events()
        publisher = core.kv_events
        assert isinstance(publisher, ZmqEventPublisher) and publisher.replay_endpoint
        deadline = time.monotonic() + 30
        while len(publisher._sent) < publisher._next_seq and time.monotonic() < deadline:
            time.sleep(0.01)
        batches = replayed(publisher.replay_endpoint, 0)
    finally:
        core.close()
    events_seen = [event for _, batch in batches for event in batch.events]
    stored = [event for event in events_seen if isinstance(event, VllmBlockStored)]
    hashes = [h for event in stored for h in event.block_hashes]
    assert len(hashes) == len(set(hashes))  # each block stored once
    first_prompt = stored[0]
    assert first_prompt.parent_block_hash is None and first_prompt.medium == "CPU"
    assert first_prompt.token_ids[:12] == shared
    # The second prompt found the shared blocks cached: its own blocks follow them.
    later = [event for event in stored[1:] if event.token_ids[:2] == [50, 51]]
    assert len(later) == 1 and later[0].parent_block_hash == first_prompt.block_hashes[2]
    assert isinstance(events_seen[-1], VllmAllBlocksCleared)
    assert external_hash(b"\x00" * 24 + (7).to_bytes(8, "big")) == 7


async def test_a_served_request_stores_its_prompt_and_a_flush_clears_it_at_once():
    """Over HTTP: the blocks of a completion's prompt are stored, under its tokens, and
    `/flush_cache` on an idle server is published without waiting for another step."""
    sender = publisher(replay_endpoint=LOCAL)
    async with app_client(enable_prefix_caching=True) as (client, engine):
        engine.core.scheduler.block_manager.events = EventLog()
        engine.core.kv_events = sender
        body = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13], "max_tokens": 2}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        await wait_until_idle(engine)
        assert (await client.post("/flush_cache")).json()["forgotten_blocks"] > 0
        deadline = time.monotonic() + 30
        while len(sender._sent) < sender._next_seq and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert sender.replay_endpoint is not None
        batches = replayed(sender.replay_endpoint, 0)
    events = [event for _, batch in batches for event in batch.events]
    assert isinstance(events[0], VllmBlockStored)
    assert events[0].token_ids[:8] == [5, 6, 7, 8, 9, 10, 11, 12]
    assert isinstance(events[-1], VllmAllBlocksCleared)


def test_a_data_parallel_rank_s_batches_carry_its_rank():
    sender = publisher(rank=3)
    try:
        socket, _ = subscribed(sender.endpoint, "", sender)
        sender.publish([AllBlocksCleared()])
        assert socket.poll(30_000)
        _, _, payload = socket.recv_multipart()
        socket.close(linger=0)
    finally:
        sender.close()
    batch = DECODER.decode(payload)
    assert batch.data_parallel_rank == 3 and batch.events == [VllmAllBlocksCleared()]
