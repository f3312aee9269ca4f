"""A hub model fetched as vLLM's flags ask (`engine/loading/hub.py`): `--revision`,
`--tokenizer-revision`, `--download-dir` and `--hf-token` reach the hub's download, the engine
loads the local folder, and replies still name the model as given."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.config import CacheConfig, EngineConfig
from engine.factory import create_engine_core
from engine.loading.hub import fetched, is_hub_id
from server.cli import build_parser, engine_config
from server.cli import main as cli_main
from tests.helpers import CHAT_TEMPLATE, chat_tokenizer, tiny_llama


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """A hub of two repositories, a model (whose tokenizer has no chat template at `main` and
    one at `v2`) and a tokenizer; `snapshot_download` answers from folders and records each
    call."""
    import huggingface_hub

    folders = {}
    for repo, revision in (("org/tiny", "main"), ("org/tiny", "v2"), ("org/tokenizer", "main")):
        folder = tmp_path / repo.replace("/", "--") / revision
        folder.mkdir(parents=True)
        if repo == "org/tiny":
            tiny_llama().save_pretrained(folder)
        tokenizer = chat_tokenizer()
        plain = (repo, revision) == ("org/tiny", "main")
        tokenizer.chat_template = None if plain else CHAT_TEMPLATE
        tokenizer.save_pretrained(folder)
        folders[repo, revision] = folder
    calls: list[dict] = []

    def snapshot_download(repo_id: str, **options: object) -> str:
        calls.append({"repo": repo_id, **options})
        revision = options.get("revision") or "main"
        if (repo_id, revision) not in folders:
            raise OSError(f"{repo_id} has no revision {revision}")
        return str(folders[repo_id, revision])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_without_the_flags_a_hub_id_is_left_to_transformers(hub: list[dict]) -> None:
    config = EngineConfig(model="org/tiny")
    assert fetched(config) is config and hub == []


def test_the_revision_and_folder_reach_the_download_and_replies_keep_the_name(
    hub: list[dict], tmp_path: Path
) -> None:
    argv = ["serve", "--model", "org/tiny", "--revision", "v2", "--download-dir", str(tmp_path)]
    argv += ["--hf-token", "secret", "--num-blocks", "16"]
    config = engine_config(build_parser().parse_args(argv))
    _, loaded, info = create_engine_core(config)
    assert info.model_name == info.model_path == "org/tiny"
    assert hub == [
        {
            "repo": "org/tiny",
            "revision": "v2",
            "cache_dir": str(tmp_path),
            "token": "secret",
            "allow_patterns": hub[0]["allow_patterns"],
        }
    ]
    assert "*.safetensors" in hub[0]["allow_patterns"]
    assert loaded.path.endswith("v2")
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE  # v2's tokenizer, with the model


def test_a_tokenizer_revision_takes_the_tokenizer_from_that_revision(hub: list[dict]) -> None:
    config = EngineConfig(
        model="org/tiny", tokenizer_revision="v2", cache=CacheConfig(num_blocks=16)
    )
    _, loaded, _ = create_engine_core(config)
    assert [(call["repo"], call["revision"]) for call in hub] == [
        ("org/tiny", None),
        ("org/tiny", "v2"),
    ]
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert loaded.path.endswith("main")


def test_another_tokenizer_repository_is_fetched_at_its_own_revision(hub: list[dict]) -> None:
    config = fetched(EngineConfig(model="org/tiny", tokenizer="org/tokenizer", revision="v2"))
    assert [(call["repo"], call["revision"]) for call in hub] == [
        ("org/tiny", "v2"),
        ("org/tokenizer", None),
    ]
    assert config.tokenizer is not None and config.tokenizer.endswith("main")


def test_a_missing_revision_is_refused_by_name(hub: list[dict]) -> None:
    with pytest.raises(ValueError, match="cannot fetch org/tiny at revision v9"):
        create_engine_core(EngineConfig(model="org/tiny", revision="v9"))


def test_local_folders_and_gguf_files_are_not_hub_ids(tmp_path: Path) -> None:
    assert is_hub_id("org/tiny") and is_hub_id("gpt2")
    assert not is_hub_id(str(tmp_path))
    assert not is_hub_id("org/tiny-GGUF:Q4_K_M") and not is_hub_id("./model.gguf")
    assert not is_hub_id(None)


def test_download_fetches_the_revision_ahead_of_serving(hub: list[dict], capsys) -> None:
    assert cli_main(["download", "--model", "org/tiny", "--revision", "v2"]) == 0
    assert capsys.readouterr().out.strip().endswith("v2")
    assert [(call["repo"], call["revision"]) for call in hub] == [("org/tiny", "v2")]
    assert cli_main(["download", "--model", "org/tiny", "--revision", "v9"]) == 2


def test_overrides_of_a_hub_model_fetch_the_folder_they_overlay(hub: list[dict]) -> None:
    config = fetched(EngineConfig(model="org/tiny", hf_overrides={"rope_theta": 1e6}))
    assert [(call["repo"], call["revision"]) for call in hub] == [("org/tiny", None)]
    assert config.model is not None and config.model.endswith("main")
    assert config.model_name == "org/tiny"
