"""`conveyor chat` and `conveyor complete` (as `vllm chat` and `vllm complete`) against a live
server: the streamed reply printed is the server's reply, a chat keeps its conversation, and
the input's end ends the session."""

from __future__ import annotations

import asyncio
import io
import re

import httpx
import pytest

from server import client_cli
from server.cli import build_parser
from server.settings import ServerSettings
from tests.server_utils import live_server

MESSAGES = [{"role": "user", "content": "Hi there"}]


def run(argv: list[str], stdin: str = "") -> str:
    """The command's printed output, its input `stdin`."""
    args = build_parser().parse_args(argv)
    out = io.StringIO()
    assert args.func(args, io.StringIO(stdin), out) == 0
    return out.getvalue()


async def test_a_quick_chat_prints_the_server_s_reply():
    async with live_server() as server:
        url = f"{server.url}/v1"
        argv = ["chat", "--url", url, "-q", "Hi there", "--max-tokens", "6", "--temperature", "0"]
        printed = await asyncio.to_thread(run, argv)
        body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0}
        async with httpx.AsyncClient(timeout=60) as client:
            reply = (await client.post(f"{url}/chat/completions", json=body)).json()
        assert printed == reply["choices"][0]["message"]["content"] + "\n"


async def test_an_interactive_chat_keeps_its_conversation_until_the_input_ends(monkeypatch):
    sent: list[list[dict]] = []
    replies: list[str] = []
    printed_by = client_cli._printed

    def recorded(client, path, body, *rest):
        sent.append([dict(m) for m in body["messages"]])
        replies.append(printed_by(client, path, body, *rest))
        return replies[-1]

    monkeypatch.setattr(client_cli, "_printed", recorded)
    async with live_server() as server:
        url = f"{server.url}/v1"
        argv = ["chat", "--url", url, "--max-tokens", "3", "--system-prompt", "Be brief."]
        printed = await asyncio.to_thread(run, argv, "first\n\nsecond\n")
    assert len(sent) == 2  # the blank line sent nothing
    assert sent[1] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": "second"},
    ]
    assert printed == f"> {replies[0]}\n> > {replies[1]}\n> \n"  # the last prompt met the end


async def test_a_quick_completion_prints_the_continuation():
    async with live_server(ServerSettings(served_model_name="tiny", api_key="k")) as server:
        url = f"{server.url}/v1"
        argv = ["complete", "--url", url, "--api-key", "k", "-q", "Once", "--max-tokens", "5"]
        argv += ["--temperature", "0"]
        printed = await asyncio.to_thread(run, argv)
        body = {"prompt": "Once", "max_tokens": 5, "temperature": 0}
        headers = {"Authorization": "Bearer k"}
        async with httpx.AsyncClient(timeout=60, headers=headers) as client:
            reply = (await client.post(f"{url}/completions", json=body)).json()
        assert printed == reply["choices"][0]["text"] + "\n"
        with pytest.raises(SystemExit, match="HTTP 401"):
            await asyncio.to_thread(run, ["complete", "--url", url, "-q", "Once"])


def test_a_server_that_cannot_be_reached_is_said_in_one_line():
    with pytest.raises(SystemExit, match=re.escape("http://127.0.0.1:9/v1: ")):
        run(["chat", "--url", "http://127.0.0.1:9/v1", "-q", "Hi"])
