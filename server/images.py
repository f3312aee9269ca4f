"""Images in chat messages: fetched or decoded, checked, and run through the model's processor
into the prompt's token ids (each image's placeholders expanded) and the encoder's inputs.

URLs are `data:image/...;base64,...` or http(s) (fetched here, as vLLM fetches them, within a
size and a time limit), or `file://` paths under `--allowed-local-media-path`. Anything that
does not decode to an image is the client's error."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from engine.core.errors import InvalidRequestError
from engine.core.images import ImageInputs
from server.limits import RequestLimits
from server.protocol import ChatMessage

FETCH_TIMEOUT = 10.0
MAX_IMAGE_BYTES = 20 * 1024 * 1024
PARAM = "messages"


@dataclass(frozen=True, slots=True)
class LoadedImage:
    image: Any  # a PIL image in RGB
    digest: bytes  # SHA-256 of the image's bytes as sent


def image_urls(messages: list[ChatMessage]) -> list[str]:
    return [url for message in messages for url in message.image_urls]


async def load_images(urls: list[str], limits: RequestLimits) -> list[LoadedImage]:
    """Every image the URLs name, decoded; at most `limits.max_images` of them, http(s) ones
    from its `allowed_media_domains` only (where given), `file://` ones from under its
    `allowed_local_media_path` only (none without it)."""
    limit = limits.max_images
    if len(urls) > limit:
        raise InvalidRequestError(
            f"At most {limit} images may be sent in one request; got {len(urls)}.", param=PARAM
        )
    for url in urls:
        check_domain(url, limits.allowed_media_domains)
    local = limits.allowed_local_media_path
    raw = await asyncio.gather(*(image_bytes(url, local) for url in urls))
    return await asyncio.to_thread(lambda: [decode(data) for data in raw])


def check_domain(url: str, domains: frozenset[str] | None) -> None:
    """An http(s) URL's host must be one of `domains` where the server names some."""
    if domains is None or not url.startswith(("http://", "https://")):
        return
    host = (urlsplit(url).hostname or "").lower()
    if host not in domains:
        raise InvalidRequestError(
            f"Images are fetched from {', '.join(sorted(domains))} only, not {host!r}.",
            param=PARAM,
        )


async def image_bytes(url: str, local: Path | None = None) -> bytes:
    """The bytes a data URL holds, an http(s) URL serves or a `file://` URL under `local`
    names."""
    if url.startswith("data:"):
        return _data_url_bytes(url)
    if url.startswith(("http://", "https://")):
        return await _fetched(url)
    if url.startswith("file:") and local is not None:
        return await asyncio.to_thread(_local_file_bytes, url, local)
    scheme = url.split(":", 1)[0] if ":" in url else url[:16]
    also = ", or file: URLs under --allowed-local-media-path" if scheme == "file" else ""
    raise InvalidRequestError(
        f"Image URLs must be data: or http(s) URLs{also}, not {scheme!r}.", param=PARAM
    )


def _local_file_bytes(url: str, local: Path) -> bytes:
    """The file a `file://` URL names, which must lie under the folder `local` once links are
    followed (a path that leaves it is refused as one that is not there would be)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidRequestError(f"A file URL names no other host: {url}.", param=PARAM)
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(local.resolve()) or not path.is_file():
        raise InvalidRequestError(
            f"The image {url} is not a file under the allowed local media path.", param=PARAM
        )
    if path.stat().st_size > MAX_IMAGE_BYTES:
        raise InvalidRequestError(
            f"The image {url} is larger than {MAX_IMAGE_BYTES} bytes.", param=PARAM
        )
    return path.read_bytes()


def _data_url_bytes(url: str) -> bytes:
    head, _, payload = url.partition(",")
    if not head.startswith("data:image/") or not head.endswith(";base64"):
        raise InvalidRequestError(
            "An image data URL must read data:image/<type>;base64,<data>.", param=PARAM
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("An image data URL holds invalid base64.", param=PARAM) from None


async def _fetched(url: str) -> bytes:
    try:
        async with (
            httpx.AsyncClient(timeout=FETCH_TIMEOUT, follow_redirects=True) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise InvalidRequestError(
                    f"Fetching the image {url} answered HTTP {response.status_code}.", param=PARAM
                )
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise InvalidRequestError(
                        f"The image {url} is larger than {MAX_IMAGE_BYTES} bytes.", param=PARAM
                    )
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as exc:
        why = f"The image {url} could not be fetched: {exc}"
        raise InvalidRequestError(why, param=PARAM) from exc


def decode(data: bytes) -> LoadedImage:
    """The image in `data`, in RGB; a file that is not one (or would decompress to an
    unreasonable size) is refused."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombWarning) as exc:
        raise InvalidRequestError(f"An image could not be read: {exc}", param=PARAM) from None
    except Image.DecompressionBombError as exc:
        raise InvalidRequestError(f"An image is too large: {exc}", param=PARAM) from None
    return LoadedImage(image.convert("RGB"), hashlib.sha256(data).digest())


def processed_prompt(
    processor: Any,
    image_token_id: int,
    text: str,
    images: list[LoadedImage],
    add_special_tokens: bool,
    processor_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], ImageInputs]:
    """The templated `text` and its images through the model's processor (with the server's
    `processor_kwargs`): the prompt's token ids, each image's placeholder expanded, and what
    the encoder reads."""
    try:
        processed = processor(
            text=[text],
            images=[image.image for image in images],
            return_tensors="pt",
            add_special_tokens=add_special_tokens,
            **(processor_kwargs or {}),
        )
    except (ValueError, TypeError) as exc:  # e.g. placeholders that do not match the images
        raise InvalidRequestError(f"The images could not be processed: {exc}", param=PARAM) from exc
    ids = processed["input_ids"][0].tolist()
    try:
        inputs = ImageInputs.of(ids, image_token_id, [image.digest for image in images], processed)
    except ValueError:
        raise InvalidRequestError(
            "The chat template placed none of the images in the prompt.", param=PARAM
        ) from None
    return ids, inputs


def processor_arguments(processor: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`--mm-processor-kwargs` as the processor takes them: Qwen-VL's `min_pixels` and
    `max_pixels` (as vLLM's recipes give them) become the bounds of its image processor's
    `size`, which transformers reads in their place."""
    pixels = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}
    image_processor = getattr(processor, "image_processor", None)
    size = getattr(image_processor, "size", None)
    bounds = {edge: getattr(size, edge, None) for edge in pixels.values()}
    if "size" in kwargs or not set(kwargs) & set(pixels) or None in bounds.values():
        return kwargs
    for name, edge in pixels.items():
        if name in kwargs:
            bounds[edge] = kwargs[name]
    rest = {key: value for key, value in kwargs.items() if key not in pixels}
    return {**rest, "size": bounds}


def check_processor_kwargs(processor: Any, kwargs: dict[str, Any]) -> None:
    """Refuse at start `--mm-processor-kwargs` for a model that reads no images, or that its
    processor fails on where it processes a small image without them."""
    if not kwargs:
        return
    if processor is None:
        raise ValueError("--mm-processor-kwargs: this model reads no images")
    kwargs = processor_arguments(processor, kwargs)
    token = getattr(processor, "image_token", None)
    if not isinstance(token, str):
        return
    from PIL import Image

    probe = {"text": [token], "images": [Image.new("RGB", (64, 64))], "return_tensors": "pt"}
    try:
        processor(**probe)
    except Exception:  # the probe itself does not suit this processor: nothing to compare
        return
    try:
        processor(**probe, **kwargs)
    except Exception as exc:
        raise ValueError(f"--mm-processor-kwargs: the processor refuses them: {exc}") from None
