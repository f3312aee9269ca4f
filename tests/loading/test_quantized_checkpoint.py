"""Quantized checkpoints as `--model` (`engine/loading/quantized_checkpoint.py`): AWQ, GPTQ,
compressed-tensors (written by compressed-tensors itself) and FP8 ones converted once into the
cache, each quantized layer's weight exactly what it stores, served with transformers' greedy
tokens for those weights, their 4- and 8-bit groups held as blocks on the CPU (symmetric ones in
GGUF's Q4_1 and Q8_0, which take 8-bit activations), and refused by name where the packing is
one Conveyor does not read."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.kernels.cpu.linear import PanelLinear
from engine.kernels.cpu.ops import panel_linear_available
from engine.loading import gguf_blocks, quantized_checkpoint
from engine.loading.gguf_blocks import MXFP4
from engine.loading.model_loader import checkpoint_path
from engine.loading.quantized_checkpoint import load_options
from engine.models.llama import PagedLlamaLayer
from server.cli import build_parser, engine_config
from server.cli import main as cli_main
from tests.helpers import (
    CHAT_TEMPLATE,
    NO_PANELS,
    chat_tokenizer,
    int8_layer_errors,
    reference_greedy,
    run_all,
    tiny_llama,
    tiny_qwen2,
    tokens_of,
)
from tests.models.test_gpt_oss import save_mxfp4
from tests.models.test_moe import build
from tests.quantized_checkpoints import (
    Layout,
    quantize_saved,
    write_compressed_tensors,
    write_fp8_blocks,
    write_quantized,
)
from tests.vision_utils import (
    image_prompt,
    processor_of,
    random_image,
    reference_tokens,
    tiny_qwen2_5_vl,
)

PROMPTS = [[5, 9, 33, 2], list(range(10, 90)), [7] * 13]
WIDE = dict(hidden_size=128, intermediate_size=256)


def packed(
    build: Callable[[], torch.nn.Module], method: str, bits: int, group: int, **layout: bool
) -> Callable[[Path], tuple[torch.nn.Module, int]]:
    """An AWQ or GPTQ checkpoint of random integers."""

    def write(folder: Path) -> tuple[torch.nn.Module, int]:
        model = build()
        stored = Layout(method, bits, group, **layout)
        return model, write_quantized(folder, model, chat_tokenizer(), stored)

    return write


def compressed(**scheme: Any) -> Callable[[Path], tuple[torch.nn.Module, int]]:
    """A compressed-tensors checkpoint of a tiny Llama, written by compressed-tensors."""

    def write(folder: Path) -> tuple[torch.nn.Module, int]:
        model = tiny_llama()
        return model, write_compressed_tensors(folder, model, chat_tokenizer(), **scheme)

    return write


def fp8_blocks(folder: Path) -> tuple[torch.nn.Module, int]:
    model = tiny_llama()
    return model, write_fp8_blocks(folder, model, chat_tokenizer())


# name: (writer of the checkpoint and its oracle, the block format its layers are held in)
CHECKPOINTS = {
    "awq": (packed(tiny_llama, "awq", 4, 32), gguf_blocks.Q4_K),
    "awq_g128_qwen2": (packed(lambda: tiny_qwen2(**WIDE), "awq", 4, 128), gguf_blocks.Q4_K),
    "gptq": (packed(tiny_qwen2, "gptq", 4, 64), gguf_blocks.Q4_K),
    "gptq_symmetric": (packed(tiny_llama, "gptq", 4, 64, symmetric=True), gguf_blocks.Q4_1),
    "gptq_8bit_rows_v2": (packed(tiny_llama, "gptq", 8, -1, v2=True), gguf_blocks.Q8_K),
    "gptq_act_order": (packed(tiny_llama, "gptq", 4, 32, act_order=True), None),
    "gptq_2bit": (packed(tiny_llama, "gptq", 2, 32), None),
    "w4a16": (compressed(bits=4, group_size=32), gguf_blocks.Q4_K),
    "w4a16_symmetric": (compressed(bits=4, group_size=64, symmetric=True), gguf_blocks.Q4_1),
    "w8a16_rows_symmetric": (compressed(bits=8, group_size=None, symmetric=True), gguf_blocks.Q8_0),
    "w8a8_int8": (compressed(bits=8, group_size=None, symmetric=True, int8=True), gguf_blocks.Q8_0),
    "fp8_w8a8": (compressed(fp8=True), None),
    "fp8_blocks": (fp8_blocks, None),
}


@pytest.fixture(autouse=True)
def conversions_in(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Conversions go to a folder of the test session, not the user's cache."""
    folder = tmp_path_factory.getbasetemp() / "conveyor-cache"
    monkeypatch.setattr(quantized_checkpoint, "cache_dir", lambda: folder)
    return folder


def quantized_checkpoint_in(folder: Path, name: str = "awq") -> tuple[torch.nn.Module, int]:
    return CHECKPOINTS[name][0](folder)


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A checkpoint of the kind, the engine serving it in fp32, and transformers' model holding
    the weights it stands for."""
    folder = tmp_path_factory.mktemp(request.param)
    reference, count = quantized_checkpoint_in(folder, request.param)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantized_checkpoint, "cache_dir", lambda: folder / "cache")
        config = EngineConfig(model=str(folder), dtype="float32", cache=CacheConfig(num_blocks=64))
        core, loaded, info = create_engine_core(config)
    return request.param, folder, core, loaded, info, reference, count


def test_a_quantized_checkpoint_serves_the_tokens_of_its_weights(served) -> None:
    _, folder, core, _, info, reference, _ = served
    assert info.model_name == str(folder)
    expected = [reference_greedy(reference, p, 10) for p in PROMPTS]
    outputs = run_all(core, PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(PROMPTS))] == expected


def test_the_conversion_holds_exactly_the_weights_in_fp32(served) -> None:
    """Each quantized layer's weight is `scale * (q - zero)` to the bit, in fp32 or as the
    blocks kept instead; fp16 tensors widen."""
    _, _, _, loaded, _, reference, count = served
    folder = Path(loaded.path)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    held: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as weights:
            held |= {name: weights.get_tensor(name) for name in weights.keys()}  # noqa: SIM118
    for layer, (fmt, rows) in gguf_blocks.load(folder).items():
        assert f"{layer}.weight" not in held, layer
        held[f"{layer}.weight"] = gguf_blocks.dequantize_rows(fmt, rows)
    expected = reference.state_dict()
    assert set(held) == set(expected)
    for name, tensor in expected.items():
        assert held[name].dtype == torch.float32
        assert torch.equal(held[name], tensor), name
    assert sum(".layers." in name and name.endswith("proj.weight") for name in held) == count


@pytest.mark.skipif(bool(NO_PANELS), reason=NO_PANELS)
def test_groups_of_whole_blocks_are_held_as_blocks(served) -> None:
    """4-bit groups as Q4_K's panels, 8-bit ones as Q8_K's; act-order and 2-bit layers stay
    fp32 panels. Conveyor's decoder joins q, k and v over the same blocks."""
    name, _, core, loaded, _, _, count = served
    expected = CHECKPOINTS[name][1]
    held = [
        module.block_format
        for module in loaded.model.modules()
        if isinstance(module, PanelLinear) and module.block_format is not None
    ]
    assert held == ([expected] * count if expected else [])
    layers = [m for m in core.runner.model.modules() if isinstance(m, PagedLlamaLayer)]
    assert {layer.qkv_proj.block_format for layer in layers} == {expected}


def test_the_tokenizer_and_chat_template_come_with_it(served) -> None:
    loaded = served[3]
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert loaded.tokenizer.eos_token_id in loaded.eos_token_ids


def test_a_conversion_is_reused_until_the_weights_change(tmp_path: Path, monkeypatch) -> None:
    quantized_checkpoint_in(tmp_path)
    first = quantized_checkpoint.ensure_converted(str(tmp_path))
    assert gguf_blocks.block_files(first)
    assert checkpoint_path(str(tmp_path)) == str(first)

    def no_conversion(*_: object) -> int:
        raise AssertionError("converted again")

    monkeypatch.setattr(quantized_checkpoint, "convert", no_conversion)
    assert quantized_checkpoint.ensure_converted(str(tmp_path)) == first
    weights = next(tmp_path.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="converted again"):
        quantized_checkpoint.ensure_converted(str(tmp_path))


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        ({"version": "gemv"}, r"AWQ checkpoint of 4 bits, version 'gemv'"),
        ({"bits": 3, "quant_method": "gptq"}, r"GPTQ checkpoint of 3 bits"),
        ({"quant_method": "gptq", "checkpoint_format": "marlin"}, r"in format 'marlin'"),
    ],
)
def test_packings_not_read_are_refused_by_what_they_are(
    tmp_path: Path, settings: dict, reason: str
) -> None:
    quantized_checkpoint_in(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] |= settings
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=reason):
        create_engine_core(EngineConfig(model=str(tmp_path)))


def test_a_checkpoint_without_safetensors_is_refused(tmp_path: Path) -> None:
    quantized_checkpoint_in(tmp_path)
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ValueError, match="needs safetensors files"):
        checkpoint_path(str(tmp_path))


def test_an_older_gptq_checkpoint_s_own_settings_file_is_read(tmp_path: Path) -> None:
    """GPTQ checkpoints from before transformers read them keep their settings in
    `quantize_config.json`, not in the config."""
    quantized_checkpoint_in(tmp_path, "gptq")
    config = json.loads((tmp_path / "config.json").read_text())
    settings = config.pop("quantization_config")
    settings.pop("quant_method")
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "quantize_config.json").write_text(json.dumps(settings))
    scheme = quantized_checkpoint.scheme_of(tmp_path)
    assert scheme == quantized_checkpoint.Scheme("gptq", 4, 64, zero_offset=1)
    converted = Path(checkpoint_path(str(tmp_path)))
    assert not (converted / "quantize_config.json").exists()


def test_download_converts_the_checkpoint_ahead_of_serving(tmp_path: Path, capsys) -> None:
    quantized_checkpoint_in(tmp_path)
    assert cli_main(["download", "--model", str(tmp_path)]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert folder == quantized_checkpoint.converted_folder(tmp_path, str(tmp_path))
    assert (folder / quantized_checkpoint.SOURCE_FILE).is_file()


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Three hub repositories in the Hugging Face cache, an AWQ one, a plain one and an MXFP4
    gpt-oss: the hub's download functions answer from folders (and record what was asked)."""
    import huggingface_hub

    repos = {
        "org/tiny-AWQ": tmp_path / "awq",
        "org/tiny": tmp_path / "plain",
        "org/tiny-mxfp4": tmp_path / "mxfp4",
    }
    for folder in repos.values():
        folder.mkdir()
    quantized_checkpoint_in(repos["org/tiny-AWQ"])
    tiny_llama().save_pretrained(repos["org/tiny"])
    save_mxfp4(repos["org/tiny-mxfp4"])
    asked: list[str] = []

    def hf_hub_download(repo_id: str, filename: str) -> str:
        asked.append(f"{repo_id}/{filename}")
        if repo_id not in repos:
            raise OSError(f"{repo_id} is not a repository")
        return str(repos[repo_id] / filename)

    def snapshot_download(repo_id: str, allow_patterns: list[str], **_options: object) -> str:
        asked.append(f"{repo_id} {' '.join(allow_patterns)}")
        return str(repos[repo_id])

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *_: None)
    quantized_checkpoint._hub_checkpoint.cache_clear()
    yield asked
    quantized_checkpoint._hub_checkpoint.cache_clear()


def test_a_hub_checkpoint_is_fetched_once_and_served_under_its_id(hub: list[str]) -> None:
    config = EngineConfig(model="org/tiny-AWQ", cache=CacheConfig(num_blocks=16))
    _, loaded, info = create_engine_core(config)
    assert info.model_name == "org/tiny-AWQ"
    assert Path(loaded.path).name.startswith("tiny-AWQ-")
    assert checkpoint_path("org/tiny-AWQ") == loaded.path
    # Its files, then its weights: the shards its index lists.
    assert hub[0] == "org/tiny-AWQ/config.json" and hub[1].startswith("org/tiny-AWQ *.json")
    shards = hub[2].split()[1:]
    assert len(hub) == 3 and shards and all(name.startswith("model-") for name in shards)


def test_an_mxfp4_hub_checkpoint_is_fetched_and_read_as_it_is(hub: list[str]) -> None:
    """Not converted: its folder is read, and in fp32 on a CPU with the panel kernel its
    experts hold their blocks."""
    path = checkpoint_path("org/tiny-mxfp4")
    assert Path(path).name == "mxfp4" and load_options(path)
    quantized_checkpoint.check_requested("org/tiny-mxfp4", "mxfp4")  # vLLM's flag names it
    config = EngineConfig(model="org/tiny-mxfp4", dtype="float32", cache=CacheConfig(num_blocks=16))
    core, loaded, info = create_engine_core(config)
    core.close()
    assert info.model_name == "org/tiny-mxfp4" and loaded.path == path
    held = [m for m in loaded.model.modules() if getattr(m, "block_format", None) is MXFP4]
    assert len(held) == (2 * 3 * 8 if panel_linear_available() else 0)  # 3 layers of 8 experts


def test_other_hub_ids_and_names_are_left_as_they_are(hub: list[str], tmp_path: Path) -> None:
    assert checkpoint_path("org/tiny") == "org/tiny"
    assert checkpoint_path("org/absent") == "org/absent"
    assert checkpoint_path("no-organisation") == "no-organisation"
    assert hub == ["org/tiny/config.json", "org/absent/config.json"]


def test_formats_not_read_here_are_dequantized_by_transformers(tmp_path: Path, monkeypatch) -> None:
    """compressed-tensors' formats Conveyor does not read (NVFP4, MXFP4) go to transformers'
    own dequantization: here a fine-grained FP8 checkpoint sent that way converts to the same
    weights as read here."""
    settings = {"format": "nvfp4-pack-quantized", "config_groups": {"g": {"weights": {}}}}
    scheme = quantized_checkpoint._all_read_here(settings)
    assert scheme is False
    reference, _ = quantized_checkpoint_in(tmp_path, "fp8_blocks")
    read_here = Path(checkpoint_path(str(tmp_path)))
    monkeypatch.setattr(
        quantized_checkpoint,
        "scheme_of",
        lambda folder: quantized_checkpoint.Scheme("fp8", 8, read_here=False),
    )
    out = tmp_path / "by-transformers"
    assert quantized_checkpoint.convert(tmp_path, out) == 0
    for folder in (read_here, out):
        with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
            for name, tensor in reference.state_dict().items():
                assert torch.equal(weights.get_tensor(name), tensor), (folder, name)
    assert (out / "tokenizer.json").is_file()


def test_the_quantization_flag_must_name_the_checkpoint_s_method(tmp_path: Path) -> None:
    """vLLM's `--quantization`: the checkpoint's own method (or vLLM's kernel names for it)
    starts; another, or any on a plain checkpoint, is refused before anything loads."""
    (tmp_path / "awq").mkdir()
    quantized_checkpoint_in(tmp_path / "awq")
    plain = tmp_path / "plain"
    tiny_llama().save_pretrained(plain)
    argv = ["serve", "--model", str(tmp_path / "awq"), "-q", "awq_marlin", "--num-blocks", "16"]
    _, loaded, _ = create_engine_core(engine_config(build_parser().parse_args(argv)))
    assert Path(loaded.path).parent.name == "quantized"
    quantized_checkpoint.check_requested(None, "gguf")  # the default model: a GGUF file
    with pytest.raises(ValueError, match=r"--quantization gptq does not match .* \(awq\)"):
        create_engine_core(EngineConfig(model=str(tmp_path / "awq"), quantization="gptq"))
    with pytest.raises(ValueError, match="does not quantize a model as it loads"):
        create_engine_core(EngineConfig(model=str(plain), quantization="fp8"))


def test_an_image_text_checkpoint_s_language_model_is_read_and_held_as_blocks(tmp_path) -> None:
    """Qwen2.5-VL-AWQ's kind: the language model's projections quantized, the vision tower
    kept in 16 bits; served with an image, transformers' tokens for the weights it holds."""
    family = "qwen2_5_vl"
    model, processor = tiny_qwen2_5_vl(), processor_of(family)
    count = write_quantized(tmp_path, model, processor.tokenizer, Layout("awq"))
    processor.save_pretrained(tmp_path)
    config = EngineConfig(model=str(tmp_path), dtype="float32", cache=CacheConfig(num_blocks=64))
    core, loaded, _ = create_engine_core(config)
    processed, ids, images = image_prompt([random_image(1), "The quick brown fox"], family)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    core.add_request("one", ids, greedy, images=images)
    outputs = []
    while core.has_unfinished():
        outputs.extend(core.step())
    assert tokens_of(outputs) == reference_tokens(model, processed, 8)
    if not NO_PANELS:
        held = [m for m in loaded.model.modules() if getattr(m, "block_format", None)]
        assert len(held) == count


@pytest.mark.skipif(bool(NO_PANELS), reason=NO_PANELS)
@pytest.mark.parametrize("name", ["gptq_symmetric", "w4a16_symmetric", "w8a8_int8"])
def test_symmetric_groups_multiply_against_8_bit_activations_on_request(
    tmp_path: Path, name: str
) -> None:
    """Symmetric groups, held in GGUF's Q4_1 and Q8_0 blocks, take `--int8-activations`: each
    projection the engine runs gives its weights times its inputs rounded to 8-bit blocks (a
    W8A8 checkpoint's INT8 products, as it was made for)."""
    quantized_checkpoint_in(tmp_path, name)
    config = EngineConfig(
        model=str(tmp_path),
        dtype="float32",
        int8_activations=True,
        cache=CacheConfig(num_blocks=64),
    )
    core, _, _ = create_engine_core(config)
    layers = [
        m for m in core.runner.model.modules() if isinstance(m, PanelLinear) and m.int8_activations
    ]
    assert len(layers) == 2 * 4  # q/k/v and gate/up joined, o and down; the head stays fp32
    errors = int8_layer_errors(layers)
    run_all(core, PROMPTS, SamplingParams(temperature=0, max_tokens=1))
    assert len(errors) == 2 * 4 and max(errors) < 1e-3


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_a_mixture_s_experts_are_read_one_by_one(tmp_path: Path, family: str) -> None:
    """A GPTQ checkpoint of a mixture of experts stores each expert's projections (Qwen3-30B-A3B
    GPTQ's kind): each expert's gate and up blocks joined and its down blocks are held as one
    block layer each (their fp32 weights not kept), as are the attention projections;
    transformers' tokens for the weights they stand for."""
    torch.manual_seed(0)
    build(family).save_pretrained(tmp_path)
    chat_tokenizer().save_pretrained(tmp_path)
    oracle = quantize_saved(tmp_path, Layout("gptq", 4, 32, symmetric=True))
    reference = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32).eval()
    config = EngineConfig(model=str(tmp_path), dtype="float32", cache=CacheConfig(num_blocks=64))
    core, loaded, _ = create_engine_core(config)
    expected = [reference_greedy(reference, p, 10) for p in PROMPTS]
    outputs = run_all(core, PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(PROMPTS))] == expected
    converted = Path(loaded.path)
    with safe_open(str(converted / "model.safetensors"), framework="pt") as weights:
        assert not any(".experts." in name for name in weights.keys())  # noqa: SIM118
    if not NO_PANELS:
        held = [m for m in loaded.model.modules() if getattr(m, "block_format", None)]
        experts = loaded.model.config.get_text_config()
        count = getattr(experts, "num_experts", None) or experts.num_local_experts
        # q, k, v and o, and each expert's two layers, of each of 3 layers
        assert len(held) == 3 * (4 + 2 * count)


def test_a_cached_hub_config_is_read_without_asking_the_hub(
    hub: list[str], tmp_path: Path, monkeypatch
) -> None:
    """An offline host with the models in its Hugging Face cache: their configs are read from
    there, the hub is not asked whether they are quantized (a quantized one's files are then
    fetched, from the cache offline)."""
    import huggingface_hub

    cached = {"org/tiny": tmp_path / "plain", "org/tiny-AWQ": tmp_path / "awq"}
    monkeypatch.setattr(
        huggingface_hub,
        "try_to_load_from_cache",
        lambda repo, name: str(cached[repo] / name) if repo in cached else None,
    )
    assert checkpoint_path("org/tiny") == "org/tiny"
    assert quantized_checkpoint.quantized_folder("org/tiny-AWQ") == tmp_path / "awq"
    assert [asked.split()[0] for asked in hub] == ["org/tiny-AWQ", "org/tiny-AWQ"]  # files, weights
