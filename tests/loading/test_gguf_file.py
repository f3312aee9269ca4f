"""A GGUF file as `--model` (`engine/loading/gguf_file.py`): converted once into the cache with
its tokenizer and chat template, served with transformers' greedy tokens for the same file, its
Q4_0 / Q4_1 / Q8_0 projections held as blocks on the CPU, and converted again when the file
changes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.kernels.cpu.linear import PanelLinear
from engine.loading import gguf_blocks, gguf_file
from engine.loading.model_loader import checkpoint_path
from engine.models.llama import PagedLlamaLayer
from server.cli import build_parser, engine_config
from server.cli import main as cli_main
from tests.gguf_files import write_gguf
from tests.helpers import (
    CHAT_TEMPLATE,
    NO_PANELS,
    TINY_SHAPE,
    chat_tokenizer,
    reference_greedy,
    run_all,
    tiny_llama,
    tiny_qwen2,
    tokens_of,
)

PROMPTS = [[5, 9, 33, 2], list(range(10, 90)), [7] * 13]


def wide_llama() -> LlamaForCausalLM:
    """Rows of 256 and 512 inputs: K-quants' super-blocks are 256 wide."""
    shape = TINY_SHAPE | dict(hidden_size=256, intermediate_size=512, initializer_range=0.02)
    config = LlamaConfig(**shape, tie_word_embeddings=False, eos_token_id=0, bos_token_id=1)
    return LlamaForCausalLM(config).eval()


def llama_types(name: str) -> QType:
    """Q4_0 projections, a Q8_0 embedding (the tied LM head's too)."""
    return QType.Q8_0 if name.startswith("token_embd") else QType.Q4_0


def qwen2_types(name: str) -> QType:
    """Q4_1 projections but F16 MLP down projections (no blocks: they stay fp32), a Q8_0
    output head and an F32 embedding."""
    if name.startswith("output"):
        return QType.Q8_0
    if name.startswith("token_embd"):
        return QType.F32
    return QType.F16 if ".ffn_down." in name else QType.Q4_1


def k_quant_types(name: str) -> QType:
    """Q4_K_M's mix (Q4_K projections, but Q6_K values, MLP down projections and head) with
    Q5_K_M's Q5_K in the attention's output and the MLP's up projections."""
    if name.startswith("token_embd"):
        return QType.F32
    if name.startswith("output") or ".attn_v." in name or ".ffn_down." in name:
        return QType.Q6_K
    if ".attn_output." in name or ".ffn_up." in name:
        return QType.Q5_K
    return QType.Q4_K


def iq_types(name: str) -> QType:
    """IQ4_XS projections (an IQ4_XS file's), IQ4_NL attention outputs, Q3_K MLP up and down
    projections (a Q3_K_M file's), a Q6_K head."""
    if name.startswith("token_embd"):
        return QType.F32
    if name.startswith("output"):
        return QType.Q6_K
    if ".attn_output." in name:
        return QType.IQ4_NL
    if ".ffn_up." in name or ".ffn_down." in name:
        return QType.Q3_K
    return QType.IQ4_XS


# (family, builder, types, layers holding blocks: 2 layers of 7 projections, and the head)
FILES = {
    "llama": (tiny_llama, llama_types, 2 * 7 + 1),
    "qwen2": (tiny_qwen2, qwen2_types, 2 * 6 + 1),
    "llama_k": (wide_llama, k_quant_types, 2 * 7 + 1),
    "llama_iq": (wide_llama, iq_types, 2 * 7 + 1),
}


@pytest.fixture(autouse=True)
def conversions_in(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Conversions go to a folder of the test session, not the user's cache."""
    folder = tmp_path_factory.getbasetemp() / "conveyor-cache"
    monkeypatch.setattr(gguf_file, "cache_dir", lambda: folder)
    return folder


@pytest.fixture(scope="module", params=list(FILES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A GGUF file of the family, the engine serving it in fp32, and transformers' own model
    loaded from the same file."""
    family = request.param
    build, types, _ = FILES[family]
    folder = tmp_path_factory.mktemp(family)
    path = folder / f"tiny-{family}.Q4.gguf"
    write_gguf(path, build(), chat_tokenizer(), types)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_file, "cache_dir", lambda: folder / "cache")
        config = EngineConfig(model=str(path), dtype="float32", cache=CacheConfig(num_blocks=64))
        core, loaded, info = create_engine_core(config)
    reference = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=path.name, dtype=torch.float32
    )
    return family, path, core, loaded, info, reference.eval()


def test_a_gguf_file_serves_transformers_tokens_for_that_file(served) -> None:
    _, path, core, _, info, reference = served
    assert info.model_name == info.model_path == str(path)  # not the converted folder
    expected = [reference_greedy(reference, p, 10) for p in PROMPTS]
    outputs = run_all(core, PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(PROMPTS))] == expected


def test_the_file_s_tokenizer_and_chat_template_come_with_it(served) -> None:
    loaded = served[3]
    tokenizer = chat_tokenizer()
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    text = "Café, naïve, 東京 🚀"
    assert (
        loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
        == tokenizer(text)["input_ids"]
    )
    assert loaded.tokenizer.eos_token_id in loaded.eos_token_ids


@pytest.mark.skipif(bool(NO_PANELS), reason=NO_PANELS)
def test_quantized_projections_are_held_as_their_blocks(served) -> None:
    """Q4_0 (as Q4_1 with minimum -8 d), Q4_1, Q8_0, Q4_K, Q5_K (as Q8_K) and Q6_K projections
    keep their blocks, a Llama's q and k rows unpermuted to match; F16 ones stay fp32."""
    family, _, _, loaded, _, _ = served
    held = [
        name
        for name, module in loaded.model.named_modules()
        if isinstance(module, PanelLinear) and module.block_format is not None
    ]
    assert len(held) == FILES[family][2], held
    assert ("model.layers.0.mlp.down_proj" in held) == (family != "qwen2")
    # Conveyor's decoder joins q, k and v: a Q4_K_M layer's two formats as Q8_K panels.
    layers = [m for m in served[2].runner.model.modules() if isinstance(m, PagedLlamaLayer)]
    joined = {layer.qkv_proj.block_format for layer in layers}
    expected = {"llama": gguf_blocks.Q4_1, "qwen2": gguf_blocks.Q4_1}
    expected |= {"llama_k": gguf_blocks.Q8_K, "llama_iq": gguf_blocks.Q8_K}
    assert joined == {expected[family]}


def test_a_conversion_is_reused_until_the_file_changes(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_llama(), chat_tokenizer(), llama_types)
    first = gguf_file.ensure_converted(str(path))
    assert gguf_blocks.block_files(first)

    def no_conversion(*_: object) -> int:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_file, "convert", no_conversion)
    assert gguf_file.ensure_converted(str(path)) == first
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="converted again"):
        gguf_file.ensure_converted(str(path))


def test_a_missing_or_unreadable_file_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such GGUF file"):
        create_engine_core(EngineConfig(model=str(tmp_path / "absent.gguf")))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ValueError, match=r"broken\.gguf"):
        gguf_file.ensure_converted(str(broken))


def test_download_converts_the_file_ahead_of_serving(tmp_path: Path, capsys) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_llama(), chat_tokenizer(), llama_types)
    assert cli_main(["download", "--model", str(path)]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert folder == gguf_file.converted_folder(path)
    assert (folder / gguf_file.SOURCE_FILE).is_file()


def test_tokenizer_flag_takes_another_folder_s_tokenizer(tmp_path: Path) -> None:
    """`--tokenizer` (vLLM's flag): the model's folder has no chat template, the other has."""
    model_dir, tokenizer_dir = tmp_path / "model", tmp_path / "tokenizer"
    tiny_llama().save_pretrained(model_dir)
    plain = chat_tokenizer()
    plain.chat_template = None
    plain.save_pretrained(model_dir)
    chat_tokenizer().save_pretrained(tokenizer_dir)
    argv = ["serve", "--model", str(model_dir), "--tokenizer", str(tokenizer_dir)]
    config = engine_config(build_parser().parse_args([*argv, "--num-blocks", "16"]))
    _, loaded, _ = create_engine_core(config)
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE


@pytest.fixture
def hub_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    """A hub repository of two GGUF files in the Hugging Face cache: `snapshot_download`
    answers from a folder, keeping the files its patterns match (and records the patterns)."""
    import fnmatch

    import huggingface_hub

    repo = tmp_path / "repo"
    repo.mkdir()
    for qtype in ("Q4_0", "Q8_0"):
        write_gguf(repo / f"tiny-{qtype}.gguf", tiny_llama(), chat_tokenizer(), llama_types)
    asked: list[list[str]] = []

    def snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
        if repo_id != "org/tiny-GGUF":
            raise OSError(f"{repo_id} is not a repository")
        asked.append(allow_patterns)
        fetched = tmp_path / "fetched" / str(len(asked))
        fetched.mkdir(parents=True)
        for path in repo.iterdir():
            if any(fnmatch.fnmatchcase(path.name, pattern) for pattern in allow_patterns):
                (fetched / path.name).write_bytes(path.read_bytes())
        return str(fetched)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    gguf_file.hub_file.cache_clear()
    yield asked
    gguf_file.hub_file.cache_clear()


def test_a_hub_repository_s_file_is_named_by_its_type(hub_repo: list[list[str]]) -> None:
    """vLLM's `REPO:QUANT`: the one file of that type (named in either case) is fetched alone
    and served under the name given."""
    assert gguf_file.is_gguf_file("org/tiny-GGUF:q4_0")
    assert not gguf_file.is_gguf_file("org/tiny")
    config = EngineConfig(model="org/tiny-GGUF:q4_0", cache=CacheConfig(num_blocks=16))
    _, loaded, info = create_engine_core(config)
    assert info.model_name == "org/tiny-GGUF:q4_0"
    assert Path(loaded.path).name.startswith("tiny-Q4_0-")
    assert all("Q8_0" not in pattern for pattern in hub_repo[0])
    # Fetched once, though a start may read the checkpoint several times (its dtype, under
    # tensor parallelism its shape, then its weights).
    assert checkpoint_path("org/tiny-GGUF:q4_0") == loaded.path
    assert len(hub_repo) == 1


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("org/tiny-GGUF:Q5_K_M", "has no Q5_K_M GGUF file"),
        ("org/tiny-GGUF:0", r"several GGUF files match \(tiny-Q4_0.gguf, tiny-Q8_0.gguf\)"),
        ("org/absent-GGUF:Q4_0", "cannot fetch it: org/absent-GGUF is not a repository"),
    ],
)
def test_a_hub_file_that_is_not_one_is_refused(hub_repo, model: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        gguf_file.ensure_converted(model)


def test_a_file_split_in_parts_serves_as_the_whole_file(tmp_path: Path) -> None:
    """llama.cpp's `gguf-split` parts, named by the first: the conversion reads every part, and
    the tokens are transformers' for the same model written whole."""
    model = tiny_llama()
    split = tmp_path / "split"
    for folder in (tmp_path / "whole", split):
        folder.mkdir()
    write_gguf(tmp_path / "whole" / "tiny.gguf", model, chat_tokenizer(), llama_types)
    write_gguf(split / "tiny.gguf", model, chat_tokenizer(), llama_types, split_max_tensors=8)
    names = sorted(path.name for path in split.iterdir())
    assert names == [f"tiny-0000{n}-of-00003.gguf" for n in (1, 2, 3)]
    first = split / names[0]
    config = EngineConfig(model=str(first), dtype="float32", cache=CacheConfig(num_blocks=64))
    core, loaded, _ = create_engine_core(config)
    assert Path(loaded.path).name.startswith("tiny-")  # named without the part numbers
    assert Path(loaded.path) == gguf_file.converted_folder(first)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path / "whole", gguf_file="tiny.gguf", dtype=torch.float32
    )
    expected = [reference_greedy(reference.eval(), prompt, 8) for prompt in PROMPTS]
    outputs = run_all(core, PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(PROMPTS))] == expected
    assert len(gguf_blocks.load(Path(loaded.path))) == FILES["llama"][2]  # every part's blocks


def test_a_later_or_missing_part_is_refused_by_name(tmp_path: Path) -> None:
    write_gguf(tmp_path / "tiny.gguf", tiny_llama(), chat_tokenizer(), llama_types, 8)
    with pytest.raises(ValueError, match=r"later part .* name tiny-00001-of-00003\.gguf"):
        gguf_file.ensure_converted(str(tmp_path / "tiny-00002-of-00003.gguf"))
    (tmp_path / "tiny-00003-of-00003.gguf").unlink()
    with pytest.raises(ValueError, match=r"missing: tiny-00003-of-00003\.gguf"):
        gguf_file.ensure_converted(str(tmp_path / "tiny-00001-of-00003.gguf"))


def test_a_hub_file_split_in_parts_is_named_by_its_type(tmp_path, monkeypatch) -> None:
    """`REPO:QUANT` where the type's file is split: its parts are fetched and served as one."""
    import huggingface_hub

    repo = tmp_path / "repo"
    repo.mkdir()
    write_gguf(repo / "tiny-Q4_0.gguf", tiny_llama(), chat_tokenizer(), llama_types, 8)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *_, **__: str(repo))
    gguf_file.hub_file.cache_clear()
    try:
        assert gguf_file.hub_file("org/tiny-GGUF", "q4_0").name == "tiny-Q4_0-00001-of-00003.gguf"
        (repo / "tiny-Q4_0-extra.gguf").write_bytes(b"")
        gguf_file.hub_file.cache_clear()
        with pytest.raises(ValueError, match="several GGUF files match"):
            gguf_file.hub_file("org/tiny-GGUF", "q4_0")
    finally:
        gguf_file.hub_file.cache_clear()
