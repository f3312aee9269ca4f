"""The tiny model as a folder, as `--model` takes it, for the tests that start ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import chat_tokenizer, tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    return folder
