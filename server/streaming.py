"""Server-sent events, merging several request streams, and watching for a client that left."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from starlette.requests import Request

from server.errors import error_body, to_api_error

# 499: the client closed the connection first (nobody reads the answer).
CLIENT_GONE = 499

T = TypeVar("T")
DONE = "data: [DONE]\n\n"
_END = object()
# Items a merged stream hands on in a row before other tasks get the loop: a request of a
# thousand prompts has a thousand deltas ready after each step, and rendering and writing them
# all at once would hold back every other client's chunks of that step.
FAIR_SHARE = 16


def _compact_json() -> Callable[[Any], str]:
    """Compact JSON text with non-ASCII kept, the same as `json.dumps(obj, ensure_ascii=False,
    separators=(",", ":"))`.

    `JSONEncoder.encode` builds its C encoder anew on every call, about half of the time for a
    small event; where the C encoder exists it is built once here and reused.
    """
    encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return encoder.encode
    try:
        # No circular-reference check (events are built here and never circular); a shared
        # check would also keep stale entries after an object failed to encode.
        encode = make(
            None,
            encoder.default,
            json.encoder.encode_basestring,
            None,
            ":",
            ",",
            False,
            False,
            True,
        )
    except TypeError:  # another interpreter's signature
        return encoder.encode

    def dumps(obj: Any) -> str:
        return "".join(encode(obj, 0))

    return dumps


compact_json = _compact_json()


def sse(payload: dict[str, Any]) -> str:
    return f"data: {compact_json(payload)}\n\n"


def named_sse(event: dict[str, Any]) -> str:
    """A server-sent event named by its `type` (the Responses and Messages APIs' streams)."""
    return f"event: {event['type']}\ndata: {compact_json(event)}\n\n"


def sse_error(exc: BaseException) -> str:
    """An error after streaming began: sent as an event, followed by [DONE] by the caller."""
    error = to_api_error(exc)
    return sse(error_body(error.message, error.type, error.param, error.code))


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Interleave several async iterators as their items arrive, tagging each with its source.

    Leaving early (or an error in one stream) cancels the rest, which closes them.
    """
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item, None))
        except Exception as exc:
            queue.put_nowait((index, None, exc))
        finally:
            queue.put_nowait((index, _END, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining, handed = len(tasks), 0
    try:
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                remaining -= 1
                continue
            yield index, item
            handed += 1
            if handed % FAIR_SHARE == 0:
                await asyncio.sleep(0)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it if the client goes away first (then return None)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result() if not task.cancelled() else None
