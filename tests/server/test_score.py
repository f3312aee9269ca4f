"""vLLM's /v1/score and /v1/rerank for an embedding model: a pair's score is the cosine of the
two texts' embeddings (as /v1/embeddings gives them), one text against many or pair by pair;
rerank orders documents by it and keeps the best top_n."""

from __future__ import annotations

import pytest
import torch

from tests.server.test_embeddings import expected
from tests.server_utils import app_client, blocks_in_use

QUERY = "The quick brown fox"
DOCS = ["Paged attention stores keys", "The quick brown fox jumps", "blocks of tokens", QUERY]


def cosine(a: str, b: str) -> float:
    return float(torch.dot(expected(a), expected(b)))


async def test_one_text_against_many_and_pair_by_pair():
    async with app_client(runner="pooling") as (client, engine):
        one = await client.post(
            "/v1/score", json={"model": "tiny", "text_1": QUERY, "text_2": DOCS}
        )
        assert one.status_code == 200, one.text
        body = one.json()
        assert body["object"] == "list" and body["model"] == "tiny"
        assert [item["index"] for item in body["data"]] == [0, 1, 2, 3]
        for item, doc in zip(body["data"], DOCS, strict=True):
            assert item["object"] == "score"
            assert item["score"] == pytest.approx(cosine(QUERY, doc), abs=1e-4)
        assert body["data"][3]["score"] == pytest.approx(1.0, abs=1e-5)
        pairs = await client.post("/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:]})
        scores = [item["score"] for item in pairs.json()["data"]]
        assert scores == pytest.approx(
            [cosine(DOCS[0], DOCS[2]), cosine(DOCS[1], DOCS[3])], abs=1e-4
        )
        assert blocks_in_use(engine) == 0


async def test_rerank_orders_documents_by_score_and_keeps_the_best_top_n():
    async with app_client(runner="pooling") as (client, _):
        ranked = await client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
        assert ranked.status_code == 200, ranked.text
        results = ranked.json()["results"]
        expected_order = sorted(range(len(DOCS)), key=lambda i: -cosine(QUERY, DOCS[i]))
        assert [r["index"] for r in results] == expected_order
        assert results[0]["document"] == {"text": QUERY}
        assert results[0]["relevance_score"] == pytest.approx(1.0, abs=1e-5)
        best = await client.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2})
        assert [r["index"] for r in best.json()["results"]] == expected_order[:2]
        v2 = await client.post("/v2/rerank", json={"query": QUERY, "documents": DOCS})
        assert [r["index"] for r in v2.json()["results"]] == expected_order


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/v1/score", {"text_1": "", "text_2": "b"}, "text_1"),
        ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
        ("/v1/rerank", {"model": "other", "query": "a", "documents": ["b"]}, "model"),
    ],
)
async def test_bad_pairs_get_a_400_naming_the_field(path, body, param):
    async with app_client(runner="pooling") as (client, _):
        response = await client.post(path, json=body)
        assert response.status_code in (400, 404)
        assert response.json()["error"]["param"] == param


async def test_a_generating_server_refuses_scores():
    async with app_client() as (client, _):
        response = await client.post("/v1/score", json={"text_1": "a", "text_2": "b"})
        assert (
            response.status_code == 400
            and "--runner pooling" in response.json()["error"]["message"]
        )
