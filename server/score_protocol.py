"""The bodies of vLLM's score and rerank routes (`/v1/score`, `/v1/rerank`), under the pooling
runner: how alike texts are, as the cosine of their embeddings."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field

from server.protocol import Int, NonNegativeInt, RequestBody, Text, TruncateTokens

Texts = Text | Annotated[list[Text], Field(min_length=1)]


class PooledFields(RequestBody):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None
    priority: Int = 0
    timeout: float | None = Field(default=None, gt=0)


class ScoreRequest(PooledFields):
    """`text_1` against each of `text_2` (one text), or pair by pair (lists of one length)."""

    text_1: Texts
    text_2: Texts


class RerankRequest(PooledFields):
    """The `documents` ranked by how alike each is to `query`; the best `top_n` (0: all)."""

    query: Text
    documents: Annotated[list[Text], Field(min_length=1)]
    top_n: NonNegativeInt = 0
