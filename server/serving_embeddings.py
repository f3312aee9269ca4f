"""POST /v1/embeddings, under the pooling runner (`conveyor serve --runner pooling`).

Each input is a prompt the engine runs to its end (chunked and prefix-cached as any other) and
whose last token's hidden state, after the final norm, comes back: last-token pooling, as
decoder embedding models (Qwen3-Embedding, e5-mistral) are pooled. The server then keeps the
first `dimensions` numbers and L2-normalizes them (unless `normalize` is false), and sends
floats or, as the OpenAI SDK asks by default, base64 of little-endian float32.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncGenerator

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.core.async_engine import RequestOptions
from engine.core.errors import InvalidRequestError
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from server.limits import RequestLimits
from server.protocol import EmbeddingRequest, PooledRequest, Prompt
from server.serving import (
    EngineClient,
    ServedModel,
    bind_trace,
    kept_tokens,
    new_id,
    submit_all,
)
from server.streaming import CLIENT_GONE, merge, unless_disconnected
from server.tokenization import (
    split_prompts,
    tokenize_prompts,
)

# A pooled prompt runs to its last token and takes one placeholder token (never sent).
POOL = SamplingParams(temperature=0, max_tokens=1)


class EmbeddingHandler:
    def __init__(
        self, engine: EngineClient, model: ServedModel, limits: RequestLimits | None = None
    ) -> None:
        self.engine = engine
        self.model = model
        self.limits = limits or RequestLimits()

    async def __call__(self, body: EmbeddingRequest, request: Request) -> Response:
        embedded = await self.embed_request(body, request)
        if embedded is None:
            return Response(status_code=CLIENT_GONE)
        vectors, tokens = embedded
        size = len(vectors[0])
        if body.dimensions is not None and body.dimensions > size:
            raise InvalidRequestError(
                f"dimensions must be at most the model's {size}, got {body.dimensions}.",
                param="dimensions",
            )
        data = [
            {"object": "embedding", "index": i, "embedding": encode(vector, body)}
            for i, vector in enumerate(vectors)
        ]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": self.model.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def embed_request(
        self, body: PooledRequest, request: Request, classify: bool = False
    ) -> tuple[list[np.ndarray], int] | None:
        """`embed` over an embeddings or classification request's own inputs and fields."""
        return await self.embed(
            body.input,
            body.truncate_prompt_tokens,
            body.priority,
            body.timeout,
            request,
            body.model,
            body.add_special_tokens,
            classify,
        )

    async def embed(
        self,
        inputs: Prompt,
        truncate: int | None,
        priority: int,
        timeout: float | None,
        request: Request,
        model: str | None,
        add_special_tokens: bool = True,
        classify: bool = False,
    ) -> tuple[list[np.ndarray], int] | None:
        """Each input's pooled state, in input order, and the prompt tokens they took; None
        when the client went away first (`/v1/score` and `/v1/rerank` embed through here, and
        `/classify`, whose classifier's pooled rows are its labels' logits)."""
        if self.model.info.runner != "pooling":
            raise InvalidRequestError(
                "This server runs the model for generation; start it with --runner pooling "
                f"to serve {'classifications' if classify else 'embeddings'}.",
                param="model",
            )
        if classify != bool(self.model.info.labels):
            raise InvalidRequestError(
                "This model classifies: use /classify."
                if self.model.info.labels
                else "This model is not a sequence classifier (*ForSequenceClassification); "
                "/classify serves one.",
                param="model",
            )
        self.model.check(model)
        prompts = await self._prompts(inputs, truncate, add_special_tokens)
        request_id = new_id("embd")
        bind_trace(request, request_id)
        options = RequestOptions(priority=priority, timeout=timeout)
        try:
            streams = submit_all(self.engine, prompts, POOL, request_id, options)
        except InvalidRequestError as exc:
            if exc.param == "prompt":  # too long for the context: the input's
                exc.param = "input"
            raise
        vectors = await unless_disconnected(request, _collect(merge(streams), len(prompts)))
        if vectors is None:
            return None
        return vectors, sum(len(prompt) for prompt in prompts)

    async def _prompts(
        self, inputs: Prompt, truncate: int | None, add_special_tokens: bool
    ) -> list[list[int]]:
        singles = split_prompts(inputs)
        if len(singles) > self.limits.max_prompts:
            raise InvalidRequestError(
                f"At most {self.limits.max_prompts} inputs are allowed in a request, got "
                f"{len(singles)}.",
                param="input",
            )
        max_model_len = self.model.info.max_model_len
        keep = kept_tokens(truncate, max_model_len)
        prompts = await tokenize_prompts(
            self.engine.tokenizer,
            singles,
            add_special_tokens,
            max_model_len,
            keep is not None,
            "input",
        )
        return [ids if keep is None else ids[-keep:] for ids in prompts]


async def _collect(
    merged: AsyncGenerator[tuple[int, RequestOutput], None], count: int
) -> list[np.ndarray]:
    """Each prompt's pooled state, in input order, as fp32 numbers."""
    vectors: list[np.ndarray | None] = [None] * count
    async for index, output in merged:
        if output.embedding is not None:
            vectors[index] = np.asarray(output.embedding.numpy(), dtype=np.float32)
    missing = [i for i, vector in enumerate(vectors) if vector is None]
    if missing:  # ended without its state (aborted): not an answer
        raise InvalidRequestError(f"Input {missing[0]} produced no embedding.", param="input")
    return [vector for vector in vectors if vector is not None]


def encode(vector: np.ndarray, body: EmbeddingRequest) -> list[float] | str:
    """The vector as the request asks: its first `dimensions`, normalized, as floats or as
    base64 of little-endian float32."""
    kept = vector[: body.dimensions] if body.dimensions is not None else vector
    if body.normalize:
        kept = kept / max(float(np.linalg.norm(kept)), 1e-12)  # as torch's normalize
    values = kept.astype("<f4")
    if body.encoding_format == "base64":
        return base64.b64encode(values.tobytes()).decode("ascii")
    return [float(x) for x in np.asarray(values, dtype=np.float64)]
