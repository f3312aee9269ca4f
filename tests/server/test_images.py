"""Images in chat requests: data URLs and fetched http URLs reach an image-text model through its
processor, and the reply is transformers' greedy reply to the same prompt; a text model, broken
or missing images, too many images and images where they cannot go get 400s in OpenAI's shape,
and the server goes on serving."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import core_from_model
from engine.loading.model_loader import load_model
from server.images import check_processor_kwargs, processor_arguments
from server.limits import RequestLimits
from server.settings import ServerSettings
from tests.server_utils import app_client, blocks_in_use, sse_events
from tests.vision_utils import (
    FAMILIES,
    data_url,
    image_prompt,
    llava_processor,
    png_bytes,
    processor_of,
    random_image,
    reference_tokens,
    save_tiny,
    tiny_image_text,
    tiny_llava,
)

BASE = {"model": "tiny", "temperature": 0, "max_tokens": 8, "ignore_eos": True}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts: dict | str) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]


def llava_client(**options):
    processor = llava_processor()
    return app_client(
        model=tiny_llava(), tokenizer=processor.tokenizer, processor=processor, **options
    )


def reference_text(parts: list) -> tuple[str, int]:
    """transformers' greedy reply to the same turn, and the prompt's length."""
    processed, ids, _ = image_prompt(parts)
    tokens = reference_tokens(tiny_llava(), processed, 8)
    return llava_processor().tokenizer.decode(tokens), len(ids)


@contextmanager
def image_host(files: dict[str, bytes]) -> Iterator[str]:
    """A local http server answering GET /NAME with the bytes `files` holds (404 otherwise)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = files.get(self.path.lstrip("/"))
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_a_data_url_image_gives_transformers_reply():
    image = random_image(1)
    async with llava_client() as (client, engine):
        response = await client.post(
            "/v1/chat/completions",
            json={**BASE, "messages": user(image_part(data_url(image)), "The quick brown fox")},
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert blocks_in_use(engine) == 0
    text, prompt_len = reference_text([image, "The quick brown fox"])
    assert body["choices"][0]["message"]["content"] == text
    # The image's placeholders count as prompt tokens, as OpenAI counts them.
    assert body["usage"]["prompt_tokens"] == prompt_len


async def test_fetched_images_and_streams_give_the_same_reply():
    first, second = random_image(2), random_image(3)
    files = {"a.png": png_bytes(first), "b.png": png_bytes(second)}
    with image_host(files) as host:
        messages = user("Hello", image_part(f"{host}/a.png"), "and", image_part(f"{host}/b.png"))
        async with llava_client() as (client, _):
            plain = await client.post("/v1/chat/completions", json={**BASE, "messages": messages})
            streamed = await client.post(
                "/v1/chat/completions", json={**BASE, "messages": messages, "stream": True}
            )
    assert plain.status_code == 200, plain.text
    text, _ = reference_text(["Hello", first, "and", second])
    assert plain.json()["choices"][0]["message"]["content"] == text
    events = sse_events(streamed.text)[:-1]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == text


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,!!!", "invalid base64"),
        ("data:image/png;base64,aGVsbG8=", "could not be read"),
        ("data:text/plain;base64,aGVsbG8=", "data:image/"),
        ("file:///etc/passwd", "data: or http(s)"),
        ("HOST/missing.png", "HTTP 404"),
        ("http://127.0.0.1:1/nothing.png", "could not be fetched"),
    ],
)
async def test_images_that_do_not_load_are_the_clients_error(url, message):
    with image_host({}) as host:
        async with llava_client() as (client, engine):
            response = await client.post(
                "/v1/chat/completions",
                json={**BASE, "messages": user(image_part(url.replace("HOST", host)), "hi")},
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert message in error["message"] and error["param"] == "messages"
            ok = await client.post(
                "/v1/chat/completions",
                json={**BASE, "messages": user(image_part(data_url(random_image(4))), "hi")},
            )
            assert ok.status_code == 200 and blocks_in_use(engine) == 0


async def test_requests_the_server_refuses():
    url = data_url(random_image(5))
    limits = ServerSettings(served_model_name="tiny", limits=RequestLimits(max_images=1))
    async with llava_client(settings=limits) as (client, _):
        cases = {
            "too many": {"messages": user(image_part(url), image_part(url))},
            "assistant": {
                "messages": [
                    *user("hi"),
                    {"role": "assistant", "content": [image_part(url)]},
                    *user("again"),
                ]
            },
            "truncated": {"messages": user(image_part(url)), "truncate_prompt_tokens": 4},
        }
        answers = {
            name: await client.post("/v1/chat/completions", json={**BASE, **body})
            for name, body in cases.items()
        }
    assert all(r.status_code == 400 for r in answers.values()), {
        k: r.text for k, r in answers.items()
    }
    assert "At most 1 images" in answers["too many"].json()["error"]["message"]
    assert "user messages" in answers["assistant"].json()["error"]["message"]
    assert answers["truncated"].json()["error"]["param"] == "truncate_prompt_tokens"


async def test_a_text_model_refuses_images_by_name():
    async with app_client() as (client, _):
        response = await client.post(
            "/v1/chat/completions",
            json={**BASE, "messages": user(image_part(data_url(random_image(6))), "hi")},
        )
        text_only = await client.post("/v1/chat/completions", json={**BASE, "messages": user("hi")})
    assert response.status_code == 400
    assert "does not take images" in response.json()["error"]["message"]
    assert text_only.status_code == 200


@pytest.mark.parametrize("family", FAMILIES)
def test_a_saved_model_loads_with_its_processor_and_matches_generate(tmp_path: Path, family):
    """From a folder, as `conveyor serve --model` loads it: transformers' image-text class, the
    processor beside it, its template on the tokenizer; fp32 over Conveyor's linear layers."""
    folder = save_tiny(tmp_path / family, family)
    loaded = load_model(str(folder), torch.float32, torch.device("cpu"))
    assert loaded.processor is not None and loaded.tokenizer.chat_template
    config = EngineConfig(model=str(folder), max_num_batched_tokens=16)
    core, info = core_from_model(loaded, config, torch.device("cpu"), torch.float32)
    assert info.image_token_id == loaded.model.config.image_token_id
    image = random_image(7)
    processed, ids, images = image_prompt([image, "Paged attention"], family)
    core.add_request(
        "r", ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), images=images
    )
    tokens: list[int] = []
    while core.has_unfinished():
        for output in core.step():
            tokens += output.new_token_ids
    assert tokens == reference_tokens(tiny_image_text(family), processed, 8)


async def test_the_messages_and_responses_apis_send_images_as_chat_does():
    """Anthropic's `image` blocks (inline or by URL) and OpenAI's Responses `input_image` parts
    reach the model as chat's image parts: the same reply."""
    image = random_image(11)
    url = data_url(image)
    payload = url.split(",", 1)[1]
    text, prompt_len = reference_text([image, "The quick brown fox"])
    with image_host({"i.png": png_bytes(image)}) as host:
        sources = [
            {"type": "base64", "media_type": "image/png", "data": payload},
            {"type": "url", "url": f"{host}/i.png"},
        ]
        async with llava_client() as (client, engine):
            messages = [
                await client.post(
                    "/v1/messages",
                    json={
                        **BASE,
                        "messages": [
                            {
                                "role": "user",
                                "content": [
                                    {"type": "image", "source": source},
                                    {"type": "text", "text": "The quick brown fox"},
                                ],
                            }
                        ],
                    },
                )
                for source in sources
            ]
            counted = await client.post(
                "/v1/messages/count_tokens",
                json={
                    "model": "tiny",
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image", "source": sources[0]},
                                {"type": "text", "text": "The quick brown fox"},
                            ],
                        }
                    ],
                },
            )
            response = await client.post(
                "/v1/responses",
                json={
                    "model": "tiny",
                    "temperature": 0,
                    "max_output_tokens": 8,
                    "ignore_eos": True,
                    "input": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "input_image", "image_url": url},
                                {"type": "input_text", "text": "The quick brown fox"},
                            ],
                        }
                    ],
                },
            )
            assert blocks_in_use(engine) == 0
    for reply in messages:
        assert reply.status_code == 200, reply.text
        assert reply.json()["content"][0]["text"] == text
        usage = reply.json()["usage"]  # the second's image comes from the prefix cache
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt_len
    assert counted.json() == {"input_tokens": prompt_len}
    assert response.status_code == 200, response.text
    assert response.json()["output"][0]["content"][0]["text"] == text


async def test_fetches_keep_to_the_allowed_domains():
    """`--allowed-media-domains`: a host outside them is refused before any fetch; data URLs
    and the hosts named go on as before."""
    image = random_image(13)
    with image_host({"i.png": png_bytes(image)}) as host:
        url = f"{host}/i.png"
        answers = {}
        for domains in (frozenset({"images.example"}), frozenset({"127.0.0.1"})):
            settings = ServerSettings(
                served_model_name="tiny", limits=RequestLimits(allowed_media_domains=domains)
            )
            async with llava_client(settings=settings) as (client, _):
                for name, link in (("fetched", url), ("inline", data_url(image))):
                    answers[(min(domains), name)] = await client.post(
                        "/v1/chat/completions",
                        json={**BASE, "messages": user(image_part(link), "hi")},
                    )
    refused = answers[("images.example", "fetched")]
    assert refused.status_code == 400
    assert "images.example only, not '127.0.0.1'" in refused.json()["error"]["message"]
    for key in (("images.example", "inline"), ("127.0.0.1", "fetched"), ("127.0.0.1", "inline")):
        assert answers[key].status_code == 200, (key, answers[key].text)


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl", "qwen3_vl"])
async def test_chat_with_images_that_attend_both_ways_or_lie_on_grids(family):
    """Through the chat route: Gemma 3's image tokens seeing each other both ways, the Qwen VL
    models' positions on three axes; the reply is transformers' greedy one."""
    first, second = random_image(2), random_image(3, width=60)
    processor = processor_of(family)
    options = {"max_num_batched_tokens": 16}
    async with app_client(
        model=tiny_image_text(family), tokenizer=processor.tokenizer, processor=processor, **options
    ) as (client, engine):
        messages = user("Hello", image_part(data_url(first)), "and", image_part(data_url(second)))
        response = await client.post("/v1/chat/completions", json={**BASE, "messages": messages})
        assert blocks_in_use(engine) == 0
    assert response.status_code == 200, response.text
    processed, _, _ = image_prompt(["Hello", first, "and", second], family)
    tokens = reference_tokens(tiny_image_text(family), processed, 8)
    assert response.json()["choices"][0]["message"]["content"] == processor.tokenizer.decode(tokens)


async def test_file_urls_read_only_under_the_allowed_local_media_path(tmp_path):
    """vLLM's `--allowed-local-media-path`: a `file://` image under it reads as the same image
    sent inline; one outside it (or reached by a link out of it), or any without the flag, is
    refused."""
    image = random_image(13)
    allowed, other = tmp_path / "media", tmp_path / "private"
    allowed.mkdir()
    other.mkdir()
    (allowed / "i.png").write_bytes(png_bytes(image))
    (other / "secret.png").write_bytes(png_bytes(image))
    (allowed / "escape.png").symlink_to(other / "secret.png")
    limits = RequestLimits(allowed_local_media_path=allowed)
    settings = ServerSettings(served_model_name="tiny", limits=limits)

    async def ask(client, link: str):
        body = {**BASE, "messages": user(image_part(link), "hi")}
        return await client.post("/v1/chat/completions", json=body)

    async with llava_client(settings=settings) as (client, _):
        local = await ask(client, (allowed / "i.png").as_uri())
        inline = await ask(client, data_url(image))
        assert local.status_code == 200, local.text
        assert local.json()["choices"] == inline.json()["choices"]
        for path in (other / "secret.png", allowed / "escape.png", allowed / "absent.png"):
            refused = await ask(client, path.as_uri())
            assert refused.status_code == 400
            assert "not a file under the allowed local media path" in refused.text
    async with llava_client() as (client, _):
        refused = await ask(client, (allowed / "i.png").as_uri())
        assert refused.status_code == 400 and "--allowed-local-media-path" in refused.text


async def test_the_servers_processor_arguments_shape_every_image():
    """vLLM's `--mm-processor-kwargs`: Qwen2.5-VL's `max_pixels` shrinks each image to fewer
    placeholders, and the reply is transformers' for the same processing."""
    image = random_image(4, width=150)
    processor = processor_of("qwen2_5_vl")
    smaller = {"max_pixels": 4 * 28 * 28}
    settings = ServerSettings(served_model_name="tiny", mm_processor_kwargs=smaller)
    model = tiny_image_text("qwen2_5_vl")
    async with app_client(
        settings, model=model, tokenizer=processor.tokenizer, processor=processor
    ) as (client, _):
        messages = user("Hello", image_part(data_url(image)))
        response = await client.post("/v1/chat/completions", json={**BASE, "messages": messages})
        larger = {"max_pixels": 10**9, "min_pixels": 10**9}
        body = {**BASE, "messages": messages, "mm_processor_kwargs": larger}
        refused = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    bounds = {"shortest_edge": 4 * 28 * 28, "longest_edge": 4 * 28 * 28}
    processed, ids, _ = image_prompt(["Hello", image], "qwen2_5_vl", size=bounds)
    assert response.json()["usage"]["prompt_tokens"] == len(ids)
    assert len(ids) < len(image_prompt(["Hello", image], "qwen2_5_vl")[1])
    tokens = reference_tokens(tiny_image_text("qwen2_5_vl"), processed, 8)
    assert response.json()["choices"][0]["message"]["content"] == processor.tokenizer.decode(tokens)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "mm_processor_kwargs"


def test_processor_arguments_are_refused_at_start_for_a_text_model_or_that_fail():
    with pytest.raises(ValueError, match="this model reads no images"):
        check_processor_kwargs(None, {"max_pixels": 1000})
    check_processor_kwargs(None, {})
    processor = processor_of("qwen2_5_vl")
    check_processor_kwargs(processor, {"max_pixels": 4 * 28 * 28})
    with pytest.raises(ValueError, match="the processor refuses them: math domain error"):
        check_processor_kwargs(processor, {"max_pixels": -5})
    # Qwen-VL's pixel bounds, as vLLM's recipes give them, become its image processor's size.
    assert processor_arguments(processor, {"max_pixels": 5000, "do_convert_rgb": True}) == {
        "do_convert_rgb": True,
        "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 5000},
    }
    llava = processor_of("llava")
    assert processor_arguments(llava, {"max_pixels": 5000}) == {"max_pixels": 5000}
