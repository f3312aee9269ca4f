"""A hub model fetched as vLLM's flags ask (`engine/loading/hub.py`): `--revision`,
`--tokenizer-revision`, `--download-dir` and `--hf-token` reach the hub's download, the engine
loads the local folder, and replies still name the model as given."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub.utils import filter_repo_objects

from engine.core.config import CacheConfig, EngineConfig
from engine.factory import create_engine_core
from engine.loading.hub import MODEL_FILES, fetched, is_hub_id, snapshot
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


def fetches(calls: list[dict]) -> list[tuple[str, str | None]]:
    """The repositories and revisions fetched, in turn (each fetch one or more downloads)."""
    pairs = [(call["repo"], call["revision"]) for call in calls]
    return [pair for i, pair in enumerate(pairs) if i == 0 or pairs[i - 1] != pair]


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
    for call in hub:
        assert call == {
            "repo": "org/tiny",
            "revision": "v2",
            "cache_dir": str(tmp_path),
            "token": "secret",
            "allow_patterns": call["allow_patterns"],
            "ignore_patterns": ["original/*"],
        }
    assert [call["allow_patterns"] for call in hub] == [MODEL_FILES, ["model.safetensors"]]
    assert loaded.path.endswith("v2")
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE  # v2's tokenizer, with the model


def test_a_tokenizer_revision_takes_the_tokenizer_from_that_revision(hub: list[dict]) -> None:
    config = EngineConfig(
        model="org/tiny", tokenizer_revision="v2", cache=CacheConfig(num_blocks=16)
    )
    _, loaded, _ = create_engine_core(config)
    assert fetches(hub) == [("org/tiny", None), ("org/tiny", "v2")]
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert loaded.path.endswith("main")


def test_another_tokenizer_repository_is_fetched_at_its_own_revision(hub: list[dict]) -> None:
    config = fetched(EngineConfig(model="org/tiny", tokenizer="org/tokenizer", revision="v2"))
    assert fetches(hub) == [("org/tiny", "v2"), ("org/tokenizer", None)]
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
    assert fetches(hub) == [("org/tiny", "v2")]
    assert cli_main(["download", "--model", "org/tiny", "--revision", "v9"]) == 2


def test_overrides_of_a_hub_model_fetch_the_folder_they_overlay(hub: list[dict]) -> None:
    config = fetched(EngineConfig(model="org/tiny", hf_overrides={"rope_theta": 1e6}))
    assert fetches(hub) == [("org/tiny", None)]
    assert config.model is not None and config.model.endswith("main")
    assert config.model_name == "org/tiny"


def remote_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: list[str]) -> list[dict]:
    """A repository of empty `files` (an index listing its `model-*` shards where it has
    one) that `snapshot_download` copies from as the hub does: the files its patterns allow
    and do not ignore."""
    import huggingface_hub

    remote, local = tmp_path / "remote", tmp_path / "local"
    for name in files:
        (remote / name).parent.mkdir(parents=True, exist_ok=True)
        (remote / name).write_text("")
    shards = [name for name in files if name.startswith("model-")]
    if "model.safetensors.index.json" in files:
        index = {"weight_map": {f"w{i}": name for i, name in enumerate(shards)}}
        (remote / "model.safetensors.index.json").write_text(json.dumps(index))
    calls: list[dict] = []

    def snapshot_download(repo_id: str, **options: Any) -> str:
        calls.append(options)
        chosen = filter_repo_objects(
            files,
            allow_patterns=options["allow_patterns"],
            ignore_patterns=options["ignore_patterns"],
        )
        for name in chosen:
            (local / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(remote / name, local / name)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def fetched_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: list[str]) -> set[str]:
    remote_repo(tmp_path, monkeypatch, files)
    folder = snapshot("org/m", None, MODEL_FILES, EngineConfig(), weights=True)
    return {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}


@pytest.mark.parametrize(
    ("files", "weights"),
    [
        (  # Mistral's: the weights twice, as shards and as one consolidated file
            ["model.safetensors.index.json", "model-1.safetensors", "model-2.safetensors",
             "consolidated.safetensors", "params.json"],
            {"model-1.safetensors", "model-2.safetensors"},
        ),
        (  # Meta's: its own copy under original/
            ["model.safetensors", "original/consolidated.safetensors", "original/params.json"],
            {"model.safetensors"},
        ),
        (  # an index that lists nothing: the next form
            ["model.safetensors.index.json", "model.safetensors", "consolidated.safetensors"],
            {"model.safetensors"},
        ),
        (["a.safetensors", "b.safetensors"], {"a.safetensors", "b.safetensors"}),
        (["pytorch_model.bin", "training_args.bin"], {"pytorch_model.bin", "training_args.bin"}),
    ],
)  # fmt: skip
def test_a_model_s_weights_are_fetched_in_one_form(tmp_path, monkeypatch, files, weights):
    got = fetched_files(tmp_path, monkeypatch, [*files, "config.json", "tokenizer.json"])
    assert {name for name in got if not name.endswith(".json")} == weights
    assert {"config.json", "tokenizer.json"} <= got
    assert not any(name.startswith("original/") for name in got)


def test_download_fetches_a_hub_model_without_flags_in_one_form_too(tmp_path, monkeypatch, capsys):
    files = ["model.safetensors", "consolidated.safetensors", "original/params.json"]
    files += ["config.json"]
    calls = remote_repo(tmp_path, monkeypatch, files)
    from engine.loading import quantized_checkpoint

    monkeypatch.setattr(quantized_checkpoint, "_hub_checkpoint", lambda repo: None)  # not one
    assert cli_main(["download", "--model", "org/m", "--ignore-patterns", "consolidated*"]) == 0
    folder = Path(capsys.readouterr().out.strip().splitlines()[-1])
    got = {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}
    assert got == {"model.safetensors", "config.json", "original/params.json"}  # as asked
    assert all(call["ignore_patterns"] == ["consolidated*"] for call in calls)
