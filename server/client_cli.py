"""`conveyor chat` and `conveyor complete`, as `vllm chat` and `vllm complete`: a terminal client
of any OpenAI-compatible server. Each line read is sent (chat keeps the conversation), and the
reply is printed as it streams; `-q TEXT` sends one message, prints the reply and exits."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import httpx

DEFAULT_URL = "http://localhost:8000/v1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the API (default {DEFAULT_URL})")
    parser.add_argument("--model-name", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default=None, help="sent as a Bearer token")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("-q", "--quick", default=None, metavar="TEXT", help="send one and exit")


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    parser.add_argument("--system-prompt", default=None)


def chat(args: argparse.Namespace, lines: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    messages: list[dict[str, str]] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    with _client(args) as client:
        model = args.model_name or _first_model(client)
        for text in _inputs(args, lines, out):
            messages.append({"role": "user", "content": text})
            body = {"model": model, "messages": messages, "stream": True}
            reply = _printed(client, "/chat/completions", body, args, out, _delta_text)
            messages.append({"role": "assistant", "content": reply})
    return 0


def complete(args: argparse.Namespace, lines: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    with _client(args) as client:
        model = args.model_name or _first_model(client)
        for text in _inputs(args, lines, out):
            body = {"model": model, "prompt": text, "stream": True}
            _printed(client, "/completions", body, args, out, lambda c: c.get("text") or "")
    return 0


def main(command: Callable[..., int]) -> Callable[..., int]:
    """`command` with a server that cannot be reached said in one line, not a traceback."""

    def run(args: argparse.Namespace, *streams: TextIO) -> int:
        try:
            return command(args, *streams)
        except httpx.HTTPError as exc:
            raise SystemExit(f"{args.url}: {exc}") from None

    return run


def _client(args: argparse.Namespace) -> httpx.Client:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=None)


def _first_model(client: httpx.Client) -> str:
    response = client.get("/models")
    if response.status_code != 200:
        raise SystemExit(f"/models: HTTP {response.status_code}: {response.text}")
    return response.json()["data"][0]["id"]


def _inputs(args: argparse.Namespace, lines: TextIO, out: TextIO) -> Iterator[str]:
    """`-q`'s text alone, or each line read until the input ends."""
    if args.quick is not None:
        yield args.quick
        return
    while True:
        out.write("> ")
        out.flush()
        line = lines.readline()
        if not line:
            out.write("\n")
            return
        if line.strip():
            yield line.rstrip("\n")


def _printed(
    client: httpx.Client,
    path: str,
    body: dict[str, Any],
    args: argparse.Namespace,
    out: TextIO,
    text_of: Callable[[dict[str, Any]], str],
) -> str:
    """Send `body`, print its streamed text as it comes, and return the whole of it."""
    for field in ("max_tokens", "temperature"):
        if getattr(args, field) is not None:
            body[field] = getattr(args, field)
    pieces = []
    with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            response.read()
            raise SystemExit(f"{path}: HTTP {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise SystemExit(f"{path}: {chunk['error'].get('message')}")
            for choice in chunk.get("choices", []):
                piece = text_of(choice)
                pieces.append(piece)
                out.write(piece)
                out.flush()
    out.write("\n")
    return "".join(pieces)


def _delta_text(choice: dict[str, Any]) -> str:
    return (choice.get("delta") or {}).get("content") or ""
