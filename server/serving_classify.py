"""POST /classify (and /v1/classify), vLLM's classification route, for a sequence classifier
served under `--runner pooling` (`engine/loading/classifiers.py`).

Each input runs to its last token as an embedding's does; the classifier's head turns that
token's hidden state into one logit per label, and the route answers each input's label (the
most likely) and every label's probability (the logits' softmax), as vLLM's does.
"""

from __future__ import annotations

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from server.protocol import ClassifyRequest
from server.serving import new_id, now
from server.serving_embeddings import EmbeddingHandler
from server.streaming import CLIENT_GONE


class ClassifyHandler:
    def __init__(self, embeddings: EmbeddingHandler) -> None:
        self.embeddings = embeddings

    async def __call__(self, body: ClassifyRequest, request: Request) -> Response:
        scored = await self.embeddings.embed_request(body, request, classify=True)
        if scored is None:
            return Response(status_code=CLIENT_GONE)
        logits, tokens = scored
        labels = self.embeddings.model.info.labels
        data = []
        for index, row in enumerate(logits):
            probs = softmax(row)
            data.append(
                {
                    "index": index,
                    "label": labels[int(np.argmax(row))],
                    "probs": [float(p) for p in probs],
                    "num_classes": len(probs),
                }
            )
        usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
        return JSONResponse(
            {
                "id": new_id("classify"),
                "object": "list",
                "created": now(),
                "model": self.embeddings.model.name,
                "data": data,
                "usage": {**usage, "prompt_tokens_details": None},
            }
        )


def softmax(logits: np.ndarray) -> np.ndarray:
    """The labels' probabilities, in fp32 (the largest logit subtracted first)."""
    shifted = np.exp(logits.astype(np.float32) - np.max(logits))
    return shifted / shifted.sum()
