"""A converted checkpoint's quantized layers kept as their blocks only
(`engine/loading/block_model.py`): held as block layers from the start on a CPU in fp32 (the
model gives transformers' greedy tokens for the file), their blocks dequantized in 16-bit forms,
a whole load and a tensor-parallel share; what the reading cannot place loads whole. Converted
weights are written shard by shard (`conversions.ShardWriter`), and a folder converted in an
older layout converts again."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.kernels.cpu.linear import PanelLinear
from engine.loading import block_model, conversions, gguf_blocks, gguf_file
from engine.loading.expert_blocks import EXPERT_LAYER
from engine.loading.gguf_tensors import block_rows
from engine.loading.model_loader import load_model, load_whole
from engine.parallel.loading import load_share
from engine.parallel.sharding import shard_model
from tests.gguf_files import write_gguf
from tests.helpers import (
    TINY_SHAPE,
    chat_tokenizer,
    needs_panels,
    reference_greedy,
    run_all,
    tiny_llama,
    tokens_of,
)
from tests.loading.test_gguf_file import k_quant_types, llama_types, wide_llama

PROMPTS = [[5, 9, 33, 2], list(range(10, 60))]


def tiny_qwen3_moe() -> Qwen3MoeForCausalLM:
    """Rows of 256 and 512 inputs for K-quants; experts 512 wide (transformers' GGUF reading
    would take 768, its config class's default) and their top-k weights renormalized, as
    Qwen3's mixtures are."""
    shape = TINY_SHAPE | dict(hidden_size=256, intermediate_size=512, initializer_range=0.02)
    config = Qwen3MoeConfig(
        **shape,
        moe_intermediate_size=512,
        norm_topk_prob=True,
        num_experts=4,
        num_experts_per_tok=2,
        head_dim=64,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=1,
    )
    return Qwen3MoeForCausalLM(config).eval()


def moe_types(name: str) -> QType:
    """Q4_K_M's experts (Q4_K gate and up, Q6_K down), Q8_0 attention and head."""
    if "_exps" in name:
        return QType.Q6_K if ".ffn_down_" in name else QType.Q4_K
    if name.startswith("output") or (".attn_" in name and not name.endswith("norm.weight")):
        return QType.Q8_0
    return QType.F32


def mxfp4_moe_types(name: str) -> QType:
    """llama.cpp's MXFP4_MOE mix: the experts in MXFP4, attention and head in Q8_0."""
    return QType.MXFP4 if "_exps" in name else moe_types(name)


# Each family's tiny model: Q4_0 projections with a Q8_0 tied embedding, Q4_K_M's mix, and a
# mixture of experts in K-quants and in MXFP4; and how many layers keep blocks (a Qwen3-MoE: 4
# attention projections and 4 experts' two layers in each of 2 layers, and the head).
FILES = {
    "q4_0": (tiny_llama, llama_types, 2 * 7 + 1),
    "k": (wide_llama, k_quant_types, 2 * 7 + 1),
    "moe": (tiny_qwen3_moe, moe_types, 2 * (4 + 4 * 2) + 1),
    "mxfp4_moe": (tiny_qwen3_moe, mxfp4_moe_types, 2 * (4 + 4 * 2) + 1),
}


@pytest.fixture(params=list(FILES))
def converted(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path, Any, int]:
    """A GGUF file, its conversion, transformers' own model of the file, and how many layers
    keep blocks."""
    build, types, count = FILES[request.param]
    path = tmp_path / "tiny.gguf"
    model = build()
    write_gguf(path, model, chat_tokenizer(), types)
    folder = tmp_path / "converted"
    gguf_file.convert(path, folder, "tiny")
    return path, folder, reference_of(path, model.config), count


def reference_of(path: Path, config: Any) -> torch.nn.Module:
    """transformers' model of `config` (the one the file was written from) holding the weights
    transformers' GGUF reading makes of the file."""
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=reference)
    missing, unexpected = reference.load_state_dict(tensors["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if config.tie_word_embeddings:
        reference.tie_weights()
    return reference.eval()


def held_weights(blocks: dict[str, Any]) -> set[str]:
    """The parameters that blocks of these layers stand for: each layer's weight, a layer's
    experts' stacked weights."""
    found = set()
    for layer in blocks:
        expert = EXPERT_LAYER.search(layer)
        if expert is None:
            found.add(f"{layer}.weight")
        else:
            found.add(f"{layer[: expert.start()]}.experts.{expert[1]}_proj")
    return found


def stored_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def test_a_conversion_keeps_quantized_layers_as_their_blocks_only(converted, tmp_path) -> None:
    """No fp32 weight is written for a layer kept as blocks (a tied head's embedding stays);
    `plain` writes both, a checkpoint transformers loads whole."""
    path, folder, reference, count = converted
    blocks = gguf_blocks.load(folder)
    assert len(blocks) == count
    expected = reference.state_dict()
    saved = set(expected) - ({"lm_head.weight"} if reference.config.tie_word_embeddings else set())
    weights = stored_weights(folder)
    assert set(weights) == saved - held_weights(blocks)
    assert "model.embed_tokens.weight" in weights
    gguf_file.convert(path, tmp_path / "plain", "tiny", plain=True)
    plain = stored_weights(tmp_path / "plain")
    assert set(plain) == saved
    assert all(torch.equal(tensor, expected[name]) for name, tensor in plain.items())


@needs_panels
def test_block_layers_load_without_fp32_weights_and_serve_transformers_tokens(
    converted,
) -> None:
    _, folder, reference, count = converted
    config = EngineConfig(model=str(folder), dtype="float32", cache=CacheConfig(num_blocks=64))
    core, loaded, _ = create_engine_core(config)
    held = [m for m in loaded.model.modules() if isinstance(m, PanelLinear) and m.block_format]
    assert len(held) == count
    expected = [reference_greedy(reference, prompt, 8) for prompt in PROMPTS]
    outputs = run_all(core, PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(PROMPTS))] == expected


def linear_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every projection's, expert's and the head's weight, as held, in fp32 (Hugging Face's
    fused experts by `ExpertLinears`' layer names)."""
    found = {}
    for name, module in model.named_modules():
        if name.endswith(("_proj", "lm_head")) or EXPERT_LAYER.search(name):
            found[name] = module.weight.float()
        fused = getattr(module, "gate_up_proj", None)
        if isinstance(fused, torch.Tensor):
            for expert in range(fused.shape[0]):
                found[f"{name}.gate_up.{expert}"] = fused[expert].float()
                found[f"{name}.down.{expert}"] = module.down_proj[expert].float()
    return found


@pytest.fixture
def no_whole_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the model whole by transformers fails the test."""
    monkeypatch.setattr(
        AutoModelForCausalLM,
        "from_pretrained",
        lambda *args, **kwargs: pytest.fail("loaded the whole model"),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_forms_read_the_blocks_dequantized(converted, dtype, no_whole_load) -> None:
    _, folder, reference, count = converted
    loaded = load_model(str(folder), dtype, torch.device("cpu"))
    ours, theirs = linear_weights(loaded.model), linear_weights(reference)
    assert ours.keys() == theirs.keys() and len(ours) == count
    for name, weight in theirs.items():
        assert torch.equal(ours[name], weight.to(dtype).float()), name


def test_a_rank_s_share_reads_the_blocks_dequantized(converted, no_whole_load) -> None:
    _, folder, reference, _ = converted
    share, shape = load_share(str(folder), torch.float32, 1, 2)
    cut = copy.deepcopy(reference)
    assert shard_model(cut, 1, 2) == shape
    theirs = dict(cut.named_parameters())
    for name, param in share.named_parameters():
        assert torch.equal(param, theirs[name]), name


def test_a_whole_load_gives_the_layers_kept_as_blocks_their_weights(converted) -> None:
    """Where transformers loads the model (a layout the reading above does not know), a weight
    kept as blocks is its blocks dequantized, not transformers' random initialisation."""
    _, folder, reference, _ = converted
    whole = load_whole(str(folder), torch.float32)
    expected = reference.state_dict()
    for name, param in whole.named_parameters():
        assert torch.equal(param, expected[name]), name


@needs_panels
def test_a_parameter_the_checkpoint_lacks_leaves_the_model_to_load_whole(
    converted, caplog: pytest.LogCaptureFixture
) -> None:
    folder = converted[1]
    weights = stored_weights(folder)
    del weights["model.norm.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with caplog.at_level("INFO", logger=block_model.__name__):
        assert block_model.load_converted(str(folder), torch.float32, hold=True) is None
    assert "model.norm.weight" in caplog.text


def test_blocks_that_do_not_widen_to_the_weight_are_not_kept(tmp_path: Path) -> None:
    """A file's blocks are kept at conversion only where they give exactly the weight
    transformers loads (a processing step that changed it would otherwise be lost)."""
    from gguf import GGUFReader, dequantize

    path = tmp_path / "tiny.gguf"
    model = tiny_llama()
    write_gguf(path, model, chat_tokenizer(), llama_types)
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.ffn_up.weight")
    weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
    held = block_rows(tensor, "llama", model.config, weight)
    assert held is not None and held[0] is gguf_blocks.Q4_1
    changed = weight.clone()
    changed[3, 5] += 1e-3
    assert block_rows(tensor, "llama", model.config, changed) is None


def test_weights_are_written_shard_by_shard(tmp_path: Path) -> None:
    tensors = {f"layer.{i}.weight": torch.full((64, 64), float(i)) for i in range(5)}
    several = conversions.ShardWriter(tmp_path / "several", shard_bytes=2 * 64 * 64 * 4)
    single = conversions.ShardWriter(tmp_path / "single")
    for name, tensor in tensors.items():
        several.add(name, tensor)
        single.add(name, tensor)
    several.close()
    single.close()
    assert [p.name for p in (tmp_path / "single").iterdir()] == ["model.safetensors"]
    files = sorted(p.name for p in (tmp_path / "several").glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "several" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 64 * 64 * 4
    for folder in ("single", "several"):
        read: dict[str, torch.Tensor] = {}
        for file in (tmp_path / folder).glob("*.safetensors"):
            read |= load_file(file)
        assert read.keys() == tensors.keys()
        assert all(torch.equal(read[name], tensors[name]) for name in tensors)
    assert index["weight_map"]["layer.4.weight"] == files[2]


def test_blocks_are_written_shard_by_shard_and_read_back_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversion writes the blocks as they come, in shards of `BLOCK_SHARD_BYTES` (so it
    never holds them all); the shards read back as the blocks one file holds, and serve."""
    path = tmp_path / "tiny.gguf"
    model = tiny_llama()
    write_gguf(path, model, chat_tokenizer(), llama_types)
    gguf_file.convert(path, tmp_path / "single", "tiny")
    monkeypatch.setattr(gguf_blocks, "BLOCK_SHARD_BYTES", 4096)
    gguf_file.convert(path, tmp_path / "several", "tiny")
    single = gguf_blocks.block_files(tmp_path / "single")
    several = gguf_blocks.block_files(tmp_path / "several")
    assert [file.name for file in single] == ["blocks.safetensors"]
    assert len(several) > 2 and several[0].name.endswith(f"-of-{len(several):05d}.safetensors")
    whole, sharded = gguf_blocks.load(tmp_path / "single"), gguf_blocks.load(tmp_path / "several")
    assert sharded.keys() == whole.keys() and len(whole) == FILES["q4_0"][2]
    for name, (fmt, rows) in whole.items():
        assert sharded[name][0] is fmt and torch.equal(sharded[name][1], rows), name
    config = EngineConfig(
        model=str(tmp_path / "several"), dtype="float32", cache=CacheConfig(num_blocks=64)
    )
    core, _, _ = create_engine_core(config)
    outputs = run_all(core, PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    reference = reference_of(path, model.config)
    expected = [reference_greedy(reference, prompt, 8) for prompt in PROMPTS]
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(PROMPTS))] == expected


def test_a_folder_converted_in_an_older_layout_converts_again(tmp_path: Path) -> None:
    target = tmp_path / "converted"
    runs = []

    def convert(staged: Path) -> dict[str, object]:
        staged.mkdir()
        (staged / "weights").write_text(str(len(runs)))
        runs.append(staged)
        return {"source": "test"}

    assert conversions.convert_once(target, "marker.json", convert) == target
    assert conversions.convert_once(target, "marker.json", convert) == target
    assert len(runs) == 1
    record = json.loads((target / "marker.json").read_text())
    assert record == {"source": "test", "layout": conversions.LAYOUT}
    del record["layout"]  # as a release before layouts wrote it
    (target / "marker.json").write_text(json.dumps(record))
    conversions.convert_once(target, "marker.json", convert)
    assert len(runs) == 2 and (target / "weights").read_text() == "1"
    shutil.rmtree(target)


def test_a_mixture_s_settings_come_from_the_file(tmp_path: Path) -> None:
    """The experts' width the file holds, which transformers' GGUF reading leaves at its config
    class's default (768); Qwen3's top-k weights renormalized."""
    path = tmp_path / "tiny.gguf"
    model = tiny_qwen3_moe()
    write_gguf(path, model, chat_tokenizer(), moe_types)
    gguf_file.convert(path, tmp_path / "converted", "tiny")
    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert config["moe_intermediate_size"] == 512 and config["norm_topk_prob"] is True
    read = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    assert read.moe_intermediate_size == 768
