"""vLLM's `prompt_embeds` on /v1/completions: each prompt sent as its embedding rows instead of
its tokens (a base64 `torch.save` of a `[tokens, hidden]` tensor, as vLLM's clients send it),
read with `torch.load(weights_only=True)`, which builds tensors and nothing else.

The rows take the place of the prompt's token embeddings, as transformers' `inputs_embeds`
do; the prompt counts that many tokens (placeholders, id 0), and the prefix cache keys its
blocks on the rows' digest. What needs the prompt's tokens themselves is refused."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import Any

from engine.core.config import ServingInfo
from engine.core.errors import InvalidRequestError
from engine.core.images import ImageInputs
from server.protocol import CompletionRequest

PARAM = "prompt_embeds"
PLACEHOLDER = 0


def embedded_prompts(
    body: CompletionRequest, info: ServingInfo, enabled: bool
) -> list[tuple[list[int], ImageInputs]]:
    """Each prompt's placeholder token ids and its rows, checked against the model."""
    if not enabled:
        raise InvalidRequestError(
            "prompt_embeds needs a server started with --enable-prompt-embeds.", param=PARAM
        )
    check_fields(body)
    prompts = []
    for text in body.embedded_prompts:
        rows = read_rows(text, info)
        count = int(rows.shape[0])
        digest = hashlib.sha256(rows.numpy().tobytes()).digest()
        prompts.append(([PLACEHOLDER] * count, ImageInputs.embeddings(rows, count, digest)))
    return prompts


def check_fields(body: CompletionRequest) -> None:
    """What reads the prompt's own tokens cannot run on rows."""
    needs_tokens = {
        "echo": body.echo,
        "suffix": bool(body.suffix),
        "prompt_logprobs": body.prompt_logprobs is not None,
        "repetition_penalty": body.repetition_penalty not in (None, 1.0),
        "truncate_prompt_tokens": body.truncate_prompt_tokens is not None,
        "use_beam_search": bool(body.use_beam_search),
    }
    for name, asked in needs_tokens.items():
        if asked:
            raise InvalidRequestError(
                f"{name} reads the prompt's tokens, which prompt_embeds do not give.", param=name
            )


def read_rows(text: str, info: ServingInfo) -> Any:
    """The rows of one prompt: a float tensor `[tokens, hidden]` (or `[1, tokens, hidden]`) of
    the model's width, finite, that leaves room for a token."""
    import torch

    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise InvalidRequestError(
            f"prompt_embeds must be base64 of a tensor saved by torch.save: {exc}", param=PARAM
        ) from None
    try:
        rows = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as exc:  # whatever the unpickler makes of the client's bytes
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise InvalidRequestError(
            f"prompt_embeds must be base64 of a tensor saved by torch.save ({reason}).",
            param=PARAM,
        ) from None
    if not isinstance(rows, torch.Tensor) or not rows.is_floating_point():
        raise InvalidRequestError("prompt_embeds must hold a floating-point tensor.", param=PARAM)
    if rows.dim() == 3 and rows.shape[0] == 1:
        rows = rows[0]
    if rows.dim() != 2 or rows.shape[1] != info.hidden_size or rows.shape[0] == 0:
        raise InvalidRequestError(
            f"prompt_embeds must be [tokens, {info.hidden_size}] (this model's width); got "
            f"{list(rows.shape)}.",
            param=PARAM,
        )
    if rows.shape[0] >= info.max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {info.max_model_len} tokens; the prompt "
            f"embeddings have {rows.shape[0]} rows, leaving no room for a new token.",
            param=PARAM,
        )
    if not bool(torch.isfinite(rows).all()):
        raise InvalidRequestError("prompt_embeds must be finite.", param=PARAM)
    return rows.float().contiguous()
