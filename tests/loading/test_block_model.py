"""A converted checkpoint's quantized layers held as their blocks from the start
(`engine/loading/block_model.py`): their fp32 weights are never read, and the model still gives
transformers' greedy tokens for the file; what that reading cannot place loads whole. Converted
weights are written shard by shard (`conversions.ShardWriter`), and a folder converted in an
older layout converts again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.kernels.cpu.linear import PanelLinear
from engine.loading import block_model, conversions, gguf_blocks, gguf_file
from engine.loading.gguf_tensors import block_rows
from tests.gguf_files import write_gguf
from tests.helpers import (
    chat_tokenizer,
    needs_panels,
    reference_greedy,
    run_all,
    tiny_llama,
    tokens_of,
)
from tests.loading.test_gguf_file import k_quant_types, llama_types, wide_llama

PROMPTS = [[5, 9, 33, 2], list(range(10, 60))]


def converted_without_block_weights(tmp_path: Path, build, types) -> tuple[Path, Path, int]:
    """A GGUF file, and its conversion copied with every weight its blocks hold taken out of
    the safetensors: a model read from it can only have come from the blocks. Returns the
    file, the copy and how many layers keep blocks."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, build(), chat_tokenizer(), types)
    folder = tmp_path / "converted"
    gguf_file.convert(path, folder, "tiny")
    blocks = gguf_blocks.load(folder / gguf_blocks.BLOCKS_FILE)
    weights = load_file(folder / "model.safetensors")
    kept = {name: t for name, t in weights.items() if name.removesuffix(".weight") not in blocks}
    assert len(weights) - len(kept) >= len(blocks) - 1  # a tied head has no weight of its own
    save_file(kept, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return path, folder, len(blocks)


@needs_panels
@pytest.mark.parametrize(
    ("build", "types"), [(tiny_llama, llama_types), (wide_llama, k_quant_types)], ids=["q4_0", "k"]
)
def test_block_layers_load_without_their_fp32_weights(tmp_path: Path, build, types) -> None:
    path, folder, count = converted_without_block_weights(tmp_path, build, types)
    config = EngineConfig(model=str(folder), dtype="float32", cache=CacheConfig(num_blocks=64))
    core, loaded, _ = create_engine_core(config)
    held = [m for m in loaded.model.modules() if isinstance(m, PanelLinear) and m.block_format]
    assert len(held) == count == 2 * 7 + 1
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    expected = [reference_greedy(reference, prompt, 8) for prompt in PROMPTS]
    outputs = run_all(core, PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(PROMPTS))] == expected


@needs_panels
def test_a_parameter_the_checkpoint_lacks_leaves_the_model_to_load_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, folder, _ = converted_without_block_weights(tmp_path, tiny_llama, llama_types)
    weights = load_file(folder / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with caplog.at_level("INFO", logger=block_model.__name__):
        assert block_model.load_with_blocks(str(folder)) is None
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
