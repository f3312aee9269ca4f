"""An adapter folder as PEFT writes it is read into scaled low-rank pairs, and what serving it
cannot compute is refused by name."""

from __future__ import annotations

import json
import math

import pytest
from safetensors.torch import load_file, save_file

from engine.lora.adapter import LoRAError, load_adapter
from engine.models.llama import PagedLlamaForCausalLM
from tests.helpers import tiny_llama
from tests.lora.adapters import ATTENTION, MLP, save_adapter

SHAPES = PagedLlamaForCausalLM(tiny_llama()).lora_shapes()
KEY = "base_model.model.model.layers.{}.{}.{}.lora_{}.weight"


def stored(path: str, layer: int, group: str, target: str) -> tuple:
    tensors = load_file(f"{path}/adapter_model.safetensors")
    return tuple(tensors[KEY.format(layer, group, target, side)] for side in "AB")


def test_each_targeted_projection_reads_as_its_pair_with_the_scale_in_b(tmp_path):
    path = save_adapter(tmp_path, ATTENTION + MLP, seed=1, rank=4)
    adapter = load_adapter(path, SHAPES, max_rank=16)
    assert adapter.rank == 4 and adapter.targets == set(ATTENTION + MLP)
    assert len(adapter.weights) == 2 * 7
    a, b = stored(path, 1, "mlp", "down_proj")
    pair = adapter.weights[1, "down_proj"]
    assert pair.a.equal(a.float()) and pair.b.allclose(b.float() * 2.0)  # alpha 8 / rank 4


def test_rank_stabilized_adapters_scale_by_the_root_of_the_rank(tmp_path):
    path = save_adapter(tmp_path, ["q_proj"], seed=2, rank=4, use_rslora=True)
    pair = load_adapter(path, SHAPES, max_rank=16).weights[0, "q_proj"]
    _, b = stored(path, 0, "self_attn", "q_proj")
    assert pair.b.allclose(b.float() * 8 / math.sqrt(4))


def test_a_rank_above_the_limit_is_refused_with_the_flag_to_raise(tmp_path):
    path = save_adapter(tmp_path, ["v_proj"], seed=3, rank=8)
    with pytest.raises(LoRAError, match="rank 8 is above --max-lora-rank 4"):
        load_adapter(path, SHAPES, max_rank=4)


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "IA3, not LORA"),
    ],
)
def test_what_plain_lora_does_not_compute_is_refused(tmp_path, config, refusal):
    path = save_adapter(tmp_path, ["q_proj"], seed=4)
    file = tmp_path / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    with pytest.raises(LoRAError, match=refusal):
        load_adapter(path, SHAPES, max_rank=16)


def test_weights_of_other_modules_are_refused_by_name(tmp_path):
    path = save_adapter(tmp_path, ["embed_tokens", "q_proj"], seed=5)
    with pytest.raises(LoRAError, match="embed_tokens"):
        load_adapter(path, SHAPES, max_rank=16)


def test_an_adapter_of_another_model_is_refused_by_its_shapes(tmp_path):
    path = save_adapter(tmp_path, ["q_proj"], seed=6)
    wider = [{**shapes, "q_proj": (128, 128)} for shapes in SHAPES]
    with pytest.raises(LoRAError, match="64 -> 64 projection; the model's is 128 -> 128"):
        load_adapter(path, wider, max_rank=16)
    deeper = tmp_path / "adapter_model.safetensors"
    tensors = load_file(str(deeper))
    for side in "AB":
        first = tensors[KEY.format(0, "self_attn", "q_proj", side)]
        tensors[KEY.format(7, "self_attn", "q_proj", side)] = first.clone()
    save_file(tensors, str(deeper))
    with pytest.raises(LoRAError, match="names layer 7; the model has 2 layers"):
        load_adapter(path, SHAPES, max_rank=16)


def test_a_folder_without_an_adapter_is_refused(tmp_path):
    with pytest.raises(LoRAError, match=r"adapter_config\.json not found"):
        load_adapter(str(tmp_path / "nowhere"), SHAPES, max_rank=16)
    save_adapter(tmp_path, ["q_proj"], seed=7)
    (tmp_path / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAError, match="no adapter weights"):
        load_adapter(str(tmp_path), SHAPES, max_rank=16)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(LoRAError, match="could not be read"):
        load_adapter(str(tmp_path), SHAPES, max_rank=16)


def test_a_hub_repository_reads_from_its_snapshot_in_the_cache(tmp_path, monkeypatch):
    import huggingface_hub

    path = save_adapter(tmp_path / "snapshot", ["q_proj"], seed=8)
    asked: list[str] = []

    def snapshot(repo_id: str, allow_patterns: list[str]) -> str:
        asked.append(repo_id)
        if repo_id != "owner/sql-lora":
            raise huggingface_hub.errors.RepositoryNotFoundError("no such repository")
        assert "adapter_config.json" in allow_patterns
        return path

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    adapter = load_adapter("owner/sql-lora", SHAPES, max_rank=16)
    assert adapter.targets == {"q_proj"} and asked == ["owner/sql-lora"]
    with pytest.raises(LoRAError, match="no such folder, and the hub gave none"):
        load_adapter("owner/missing", SHAPES, max_rank=16)
    with pytest.raises(LoRAError, match="not found"):  # a path, not a repository: no hub
        load_adapter("./owner/sql-lora", SHAPES, max_rank=16)
    assert asked == ["owner/sql-lora", "owner/missing"]
