"""vLLM's `/v1/score` and `/v1/rerank` for an embedding model (`--runner pooling`): each text
is embedded once (as `/v1/embeddings` would embed it), and a pair's score is the cosine of its
two embeddings, as vLLM scores pairs with a model that is not a cross-encoder."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.core.errors import InvalidRequestError
from server.score_protocol import PooledFields, RerankRequest, ScoreRequest
from server.serving import new_id
from server.serving_embeddings import EmbeddingHandler
from server.streaming import CLIENT_GONE


class ScoreHandler:
    def __init__(self, embeddings: EmbeddingHandler) -> None:
        self.embeddings = embeddings

    async def score(self, body: ScoreRequest, request: Request) -> Response:
        firsts, seconds = _listed(body.text_1), _listed(body.text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise InvalidRequestError(
                f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, "
                "or as many as text_2.",
                param="text_1",
            )
        scored = await self._cosines(body, request, firsts, seconds)
        if scored is None:
            return Response(status_code=CLIENT_GONE)
        scores, tokens = scored
        return JSONResponse(
            {
                "id": new_id("score"),
                "object": "list",
                "created": int(time.time()),
                "model": self.embeddings.model.name,
                "data": [
                    {"index": i, "object": "score", "score": score}
                    for i, score in enumerate(scores)
                ],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
            }
        )

    async def rerank(self, body: RerankRequest, request: Request) -> Response:
        queries = [body.query] * len(body.documents)
        scored = await self._cosines(body, request, queries, body.documents)
        if scored is None:
            return Response(status_code=CLIENT_GONE)
        scores, tokens = scored
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        if body.top_n:
            ranked = ranked[: body.top_n]
        results: list[dict[str, Any]] = [
            {"index": i, "document": {"text": body.documents[i]}, "relevance_score": scores[i]}
            for i in ranked
        ]
        return JSONResponse(
            {
                "id": new_id("rerank"),
                "model": self.embeddings.model.name,
                "usage": {"total_tokens": tokens},
                "results": results,
            }
        )

    async def _cosines(
        self, body: PooledFields, request: Request, firsts: list[str], seconds: list[str]
    ) -> tuple[list[float], int] | None:
        """Each pair's cosine, and the tokens embedded (each distinct text once); None when
        the client went away."""
        texts = list(dict.fromkeys([*firsts, *seconds]))
        embedded = await self.embeddings.embed(
            texts, body.truncate_prompt_tokens, body.priority, body.timeout, request, body.model
        )
        if embedded is None:
            return None
        vectors, tokens = embedded
        unit = {text: _unit(vector) for text, vector in zip(texts, vectors, strict=True)}
        scores = [float(np.dot(unit[a], unit[b])) for a, b in zip(firsts, seconds, strict=True)]
        return scores, tokens


def _listed(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else list(texts)


def _unit(vector: np.ndarray) -> np.ndarray:
    return vector / max(float(np.linalg.norm(vector)), 1e-12)
