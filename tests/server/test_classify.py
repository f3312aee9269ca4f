"""/classify (vLLM's classification route) for a sequence classifier under the pooling runner:
each input's label and its labels' probabilities as transformers' classifier computes them;
refused for a model that is not a classifier, and a classifier's embeddings refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig, Qwen2Config

from engine.core.async_engine import AsyncEngine
from engine.core.config import CacheConfig, EngineConfig
from server.settings import ServerSettings
from tests.helpers import TINY_SHAPE, chat_tokenizer
from tests.server_utils import app_client, blocks_in_use, loaded_client

TEXTS = ["The quick brown fox", "Paged attention stores keys", "Hello world!"]
LABELS = ("negative", "neutral", "positive")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def classifier_dir(request: pytest.FixtureRequest, tmp_path_factory) -> Path:
    """A tiny random Llama (or Qwen2) with a three-label score head, saved with its
    tokenizer."""
    family = LlamaConfig if request.param == "llama" else Qwen2Config
    config = family(
        **TINY_SHAPE | dict(max_position_embeddings=256),
        num_labels=3,
        id2label=dict(enumerate(LABELS)),
        label2id={label: i for i, label in enumerate(LABELS)},
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("classifier")
    AutoModelForSequenceClassification.from_config(config).eval().save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    return folder


def reference_probs(folder: Path, text: str) -> torch.Tensor:
    """transformers' classifier: the last token's logits, softmaxed."""
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    ids = chat_tokenizer()(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return torch.softmax(model.eval()(ids).logits[0], dim=-1)


def classifier_client(folder: Path, runner: str = "pooling"):
    config = EngineConfig(
        model=str(folder), dtype="float32", runner=runner, cache=CacheConfig(num_blocks=32)
    )
    return loaded_client(config, ServerSettings(served_model_name="clf"))


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
async def test_each_input_gets_transformers_label_and_probabilities(classifier_dir, path):
    async with classifier_client(classifier_dir) as (client, engine):
        response = await client.post(path, json={"model": "clf", "input": TEXTS})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "list" and body["model"] == "clf"
        assert body["id"].startswith("classify-")
        for item, text in zip(body["data"], TEXTS, strict=True):
            expected = reference_probs(classifier_dir, text)
            torch.testing.assert_close(torch.tensor(item["probs"]), expected, rtol=1e-4, atol=1e-5)
            assert item["label"] == LABELS[int(expected.argmax())]
            assert item["num_classes"] == 3
        assert [item["index"] for item in body["data"]] == [0, 1, 2]
        tokens = sum(len(chat_tokenizer().encode(t)) for t in TEXTS)
        assert body["usage"] == {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        }
        assert {item["label"] for item in body["data"]} <= set(LABELS)
        assert blocks_in_use(engine) == 0


async def test_token_ids_classify_and_embeddings_are_refused(classifier_dir):
    async with classifier_client(classifier_dir) as (client, _):
        ids = chat_tokenizer().encode(TEXTS[0])
        by_ids = await client.post("/classify", json={"input": ids})
        expected = reference_probs(classifier_dir, TEXTS[0])
        torch.testing.assert_close(
            torch.tensor(by_ids.json()["data"][0]["probs"]), expected, rtol=1e-4, atol=1e-5
        )
        refused = await client.post("/v1/embeddings", json={"input": "hi"})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == "This model classifies: use /classify."
        empty = await client.post("/classify", json={"input": ""})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"


async def test_a_model_that_is_not_a_classifier_is_refused_by_classify():
    async with app_client(runner="pooling") as (client, _):
        response = await client.post("/classify", json={"input": "hi"})
        assert response.status_code == 400
        assert "not a sequence classifier" in response.json()["error"]["message"]
    async with app_client() as (client, _):
        response = await client.post("/classify", json={"input": "hi"})
        assert response.status_code == 400
        assert "--runner pooling" in response.json()["error"]["message"]


def test_a_classifier_needs_the_pooling_runner(classifier_dir):
    with pytest.raises(ValueError, match="sequence classifier: serve it with --runner pooling"):
        AsyncEngine.from_config(
            EngineConfig(model=str(classifier_dir), cache=CacheConfig(num_blocks=8))
        )


def test_probabilities_of_large_logits_stay_finite():
    from server.serving_classify import softmax

    probs = softmax(np.array([1000.0, 1001.0, 999.0], dtype=np.float32))
    assert np.isfinite(probs).all() and abs(float(probs.sum()) - 1.0) < 1e-6
    assert int(np.argmax(probs)) == 1
