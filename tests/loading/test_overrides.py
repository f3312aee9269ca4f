"""vLLM's `--hf-overrides` (`engine/loading/overrides.py`): the checkpoint overlaid once with its
config's fields replaced; a longer context by YaRN serves transformers' tokens for the same
config, the overlay is reused, and nested objects merge."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.loading import overrides
from server.cli import build_parser, engine_config
from tests.helpers import chat_tokenizer, reference_greedy, run_all, tiny_llama, tokens_of

YARN = {
    "max_position_embeddings": 1024,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 512,
    },
}


@pytest.fixture(autouse=True)
def overlays_in(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(overrides, "cache_dir", lambda: tmp_path_factory.getbasetemp() / "cache")


def test_a_longer_context_by_yarn_serves_transformers_tokens_for_that_config(tmp_path: Path):
    tiny_llama().save_pretrained(tmp_path)
    chat_tokenizer().save_pretrained(tmp_path)
    argv = ["serve", "--model", str(tmp_path), "--hf-overrides", json_of(YARN)]
    argv += ["--num-blocks", "96", "--dtype", "float32"]
    config = engine_config(build_parser().parse_args(argv))
    core, loaded, info = create_engine_core(config)
    assert info.model_name == info.model_path == str(tmp_path) and info.max_model_len == 1024
    assert loaded.model.config.rope_parameters["rope_type"] == "yarn"
    reference = AutoModelForCausalLM.from_pretrained(Path(loaded.path), dtype=torch.float32)
    assert reference.config.rope_parameters["factor"] == 2.0
    prompts = [list(range(10, 90)), [5, 9, 33, 2]]
    expected = [reference_greedy(reference.eval(), p, 8) for p in prompts]
    outputs = run_all(core, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts))] == expected
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert [reference_greedy(plain, p, 8) for p in prompts] != expected  # YaRN matters


def test_the_overlay_links_the_files_and_is_made_once(tmp_path: Path) -> None:
    tiny_llama().save_pretrained(tmp_path)
    first = overrides.overlay_folder(tmp_path, YARN)
    assert (first / "model.safetensors").resolve() == (tmp_path / "model.safetensors").resolve()
    assert overrides.overlay_folder(tmp_path, YARN) == first
    assert overrides.overlay_folder(tmp_path, {"max_position_embeddings": 2048}) != first
    original = (tmp_path / "config.json").read_text()
    assert '"yarn"' not in original and '"yarn"' in (first / "config.json").read_text()


def test_nested_objects_merge_and_other_values_replace() -> None:
    config = {"text_config": {"hidden_size": 64, "rope_theta": 1e4}, "vocab_size": 320}
    changed = overrides.merged(config, {"text_config": {"rope_theta": 1e6}, "vocab_size": 400})
    assert changed == {"text_config": {"hidden_size": 64, "rope_theta": 1e6}, "vocab_size": 400}
    assert config["text_config"]["rope_theta"] == 1e4  # the original is left as it was


@pytest.mark.parametrize("bad", ["[1, 2]", "{not json"])
def test_the_flag_takes_a_json_object_only(bad: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--hf-overrides", bad])


def test_without_overrides_the_model_is_left_as_it_is() -> None:
    config = EngineConfig(model="org/tiny", cache=CacheConfig(num_blocks=16))
    assert overrides.overridden(config) is config


def json_of(value: object) -> str:
    import json

    return json.dumps(value)
