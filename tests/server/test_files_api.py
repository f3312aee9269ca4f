"""/v1/files through the unmodified OpenAI SDK: upload, list with paging, retrieve, content and
delete, with OpenAI's shapes and errors; the files outlive the server."""

from __future__ import annotations

import asyncio
import io

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from server.batches.files import FileStore
from server.settings import ServerSettings
from tests.server_utils import live_server

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'


def settings(tmp_path, **extra) -> ServerSettings:
    return ServerSettings(served_model_name="tiny", state_dir=tmp_path, **extra)


def sdk(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_upload_retrieve_content_list_and_delete(tmp_path):
    async with live_server(settings(tmp_path)) as server:
        client = sdk(server.url)
        uploaded = await client.files.create(file=("in.jsonl", LINES), purpose="batch")
        assert uploaded.id.startswith("file-") and uploaded.object == "file"
        assert (uploaded.bytes, uploaded.filename, uploaded.purpose) == (
            len(LINES),
            "in.jsonl",
            "batch",
        )
        again = await client.files.retrieve(uploaded.id)
        assert again.model_dump() == uploaded.model_dump()
        assert (await client.files.content(uploaded.id)).content == LINES
        listed = await client.files.list()
        assert [f.id for f in listed.data] == [uploaded.id]
        deleted = await client.files.delete(uploaded.id)
        assert (deleted.id, deleted.deleted) == (uploaded.id, True)
        with pytest.raises(openai.NotFoundError) as missing:
            await client.files.retrieve(uploaded.id)
        assert missing.value.body["param"] == "id"
        assert list(tmp_path.joinpath("files").iterdir()) == []


async def test_listing_pages_newest_first_and_filters_by_purpose(tmp_path):
    async with live_server(settings(tmp_path)) as server:
        client = sdk(server.url)
        ids = []
        for i in range(5):
            purpose = "batch" if i % 2 == 0 else "user_data"
            created = await client.files.create(file=(f"{i}.jsonl", LINES), purpose=purpose)
            ids.append(created.id)
        first = await client.files.list(limit=2)
        assert [f.id for f in first.data] == ids[::-1][:2] and first.has_more
        everything = [f.id async for f in client.files.list(limit=2)]  # the SDK follows `after`
        assert everything == ids[::-1]
        oldest = await client.files.list(order="asc", limit=10)
        assert [f.id for f in oldest.data] == ids and not oldest.has_more
        batch = await client.files.list(purpose="batch")
        assert [f.id for f in batch.data] == [ids[4], ids[2], ids[0]]


@pytest.mark.parametrize(
    ("purpose", "content", "says"),
    [("fine-tune", LINES, "purpose must be one of"), ("batch", b"x" * 4096, "limit of")],
    ids=["purpose", "too large"],
)
async def test_bad_uploads_get_a_400_and_store_nothing(tmp_path, purpose, content, says):
    async with live_server(settings(tmp_path, max_file_bytes=1024)) as server:
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk(server.url).files.create(file=("f.jsonl", content), purpose=purpose)
        assert says in refused.value.body["message"]
    files = tmp_path / "files"
    assert not files.exists() or not any(files.iterdir())


async def test_files_outlive_the_server(tmp_path):
    async with live_server(settings(tmp_path)) as server:
        uploaded = await sdk(server.url).files.create(file=("in.jsonl", LINES), purpose="batch")
    async with live_server(settings(tmp_path)) as server:
        client = sdk(server.url)
        assert (await client.files.retrieve(uploaded.id)).bytes == len(LINES)
        assert (await client.files.content(uploaded.id)).content == LINES


def test_a_crash_mid_upload_leaves_no_file(tmp_path):
    """Bytes of an upload that never got its record (a crash between the two) are removed when
    the store opens again; recorded files stay."""
    store = FileStore(tmp_path)
    kept = store.add(io.BytesIO(LINES), "kept.jsonl", "batch")
    store.close()
    (tmp_path / "files" / "file-orphan").write_bytes(b"half")
    (tmp_path / "files" / "file-x.partial").write_bytes(b"half")
    store = FileStore(tmp_path)
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [kept.id]
    assert store.get(kept.id) == kept
    store.close()


def test_nothing_is_written_until_a_file_is_uploaded(tmp_path):
    async def run() -> None:
        async with live_server(settings(tmp_path / "state")) as server:
            await sdk(server.url).models.list()

    asyncio.run(run())
    assert not (tmp_path / "state").exists()


async def test_a_wrong_method_lists_every_method_the_path_serves(tmp_path):
    async with live_server(settings(tmp_path)) as server, httpx.AsyncClient() as client:
        files = await client.put(f"{server.url}/v1/files")
        one = await client.post(f"{server.url}/v1/files/file-1")
    assert files.status_code == one.status_code == 405
    assert set(files.headers["allow"].split(", ")) == {"GET", "POST"}
    assert set(one.headers["allow"].split(", ")) == {"DELETE", "GET"}
