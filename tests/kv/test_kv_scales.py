"""An fp8 KV cache with per-layer scales: read from a checkpoint, or calibrated on the first
step (`--calculate-kv-scales`), stored and read back alike by every backend that takes them."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention import get_backend, triton_paged
from engine.attention.torch_paged import TorchPagedAttention
from engine.attention.triton_paged import TritonPagedAttention
from engine.core.sampling_params import SamplingParams
from engine.kv.kv_cache import KVCache, KVCacheSpec
from engine.kv.kv_scales import KEY_RANGE, VALUE_RANGE, calibrated_scales, checkpoint_kv_scales
from engine.worker.cuda_graphs import DecodeGraphs
from server.cli import build_parser, engine_config
from tests.attention.test_paged_attention import mixed_step, naive_attention
from tests.conftest import CUDA, TRITON_DEVICE, needs_triton
from tests.helpers import needs_cpu_kernels, run_all, tiny_core, tiny_llama, tokens_of
from tests.kv.test_kv_cache_dtype import assert_agree
from tests.worker.graph_checks import spy_padding

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PROMPTS = [[5, 9, 33, 2], list(range(40, 120)), [7] * 13]


def fp8(x: float, dtype: torch.dtype) -> float:
    return torch.tensor(x).to(dtype).float().item()


# --- where the scales come from ---------------------------------------------------------


def test_calibrated_scales_map_the_largest_magnitudes_to_the_ranges():
    key = torch.tensor([[1.0, -8.0], [2.0, 3.0]])
    value = torch.tensor([0.5, -0.25])
    scales = calibrated_scales(key, value)
    assert scales.dtype == torch.float32
    assert scales.tolist() == pytest.approx([8.0 / KEY_RANGE, 0.5 / VALUE_RANGE])
    # Nothing to measure: the scale stays 1.0 rather than dividing by zero.
    assert calibrated_scales(torch.zeros(3), value)[0].item() == 1.0


def write_checkpoint(folder, tensors: dict[str, torch.Tensor], name="model.safetensors"):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / name))


def test_checkpoint_scales_in_every_naming(tmp_path):
    weight = torch.zeros(4, 4)
    write_checkpoint(
        tmp_path,
        {
            "model.layers.0.self_attn.k_proj.weight": weight,
            "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
            "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
            # ModelOpt's names, and a scale given per head (its largest entry is kept).
            "model.layers.1.self_attn.k_proj.k_scale": torch.tensor([0.1, 0.3]),
            "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(2.0),
            # The older single scale for both.
            "model.layers.2.self_attn.kv_scale": torch.tensor(4.0),
            # Weight quantizers' scales are not KV scales.
            "model.layers.3.self_attn.k_proj.weight_scale": torch.tensor(9.0),
            "model.layers.3.self_attn.k_proj.input_scale": torch.tensor(9.0),
        },
    )
    write_checkpoint(  # AutoFP8's output scales, in a second shard; a layer past the model's
        tmp_path,
        {
            "model.layers.3.self_attn.v_proj.output_scale": torch.tensor(8.0),
            "model.layers.9.self_attn.k_scale": torch.tensor(7.0),
        },
        "model-2.safetensors",
    )
    scales = checkpoint_kv_scales(str(tmp_path), num_layers=5)
    assert scales is not None
    expected = [[0.5, 0.25], [0.3, 2.0], [4.0, 4.0], [1.0, 8.0], [1.0, 1.0]]
    torch.testing.assert_close(scales, torch.tensor(expected))


def test_no_scales_no_folder_and_bad_scales(tmp_path):
    write_checkpoint(tmp_path, {"model.layers.0.self_attn.k_proj.weight": torch.zeros(2, 2)})
    assert checkpoint_kv_scales(str(tmp_path), 2) is None
    assert checkpoint_kv_scales("", 2) is None  # a model built in memory
    assert checkpoint_kv_scales(str(tmp_path / "absent"), 2) is None
    write_checkpoint(
        tmp_path, {"model.layers.0.self_attn.k_scale": torch.tensor(0.0)}, "z.safetensors"
    )
    with pytest.raises(ValueError, match=r"k_scale is 0\.0, not a positive scale"):
        checkpoint_kv_scales(str(tmp_path), 2)


def test_flag_and_config():
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    assert engine_config(args).cache.calculate_kv_scales
    plain = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert not engine_config(plain).cache.calculate_kv_scales


# --- what the cache stores and what attention reads -----------------------------------


def test_the_torch_store_divides_by_the_layer_scales_and_reads_back():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype=E4M3, block_size=4)
    cache = KVCache(spec, num_blocks=2, device=torch.device("cpu"))
    assert cache.scaled and cache.scales.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    cache.scales[1] = torch.tensor([4.0, 0.5])
    key = torch.tensor([[[8.0, -4.0, 4000.0, 1.0]]])
    cache.write(1, torch.tensor([5]), key, key)
    assert cache.key(1)[1, 1, 0].float().tolist() == [2.0, -1.0, 448.0, 0.25]  # saturated
    assert cache.value(1)[1, 1, 0].float().tolist() == [16.0, -8.0, 448.0, 2.0]
    widened = cache.widened(1, 0, cache.key(1)[1, 1], torch.float32)
    assert widened[0].tolist() == [8.0, -4.0, 1792.0, 1.0]
    assert cache.key(0).float().abs().sum() == 0  # the other layer untouched
    # What a fresh prompt attends over is what a later read of the cache gives.
    assert torch.equal(cache.round_trip(1, 0, key)[0], widened)


def scaled_step(backend_name: str, device: str, calibrated: bool):
    """Decodes, fresh prompts and chunks after a cached prefix in one step over an e4m3 cache,
    with K spread far past e4m3's largest value (448) and V deep in its subnormals: the
    attention, in units of V's spread, against naive attention over the exact K/V."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block_size = 4, 2, 32, 4
    spec = KVCacheSpec(1, kv_heads, dim, E4M3, block_size)
    cache = KVCache(spec, num_blocks=64, device=torch.device(device))
    backend = get_backend(backend_name, torch.device(device))
    contexts, queries = [0, 5, 9, 0], [1, 1, 4, 6]
    total = [c + q for c, q in zip(contexts, queries, strict=True)]
    key_spread, value_spread = 300.0, 1e-3
    history = {
        i: (
            torch.randn(t, kv_heads, dim, device=device) * key_spread,
            torch.randn(t, kv_heads, dim, device=device) * value_spread,
        )
        for i, t in enumerate(total)
    }
    if calibrated:  # as the first step would have set them, from all of these K/V
        cache.calibrating = True
        keys, values = (torch.cat([h[i] for h in history.values()]) for i in (0, 1))
        cache.calibrate(0, keys, values)
        cache.end_calibration()
    batch, new_k, new_v = mixed_step(cache, history, contexts, queries)  # the torch path writes
    q = torch.randn(sum(queries), heads, dim, device=device)
    scale = 1 / (key_spread * dim**0.5)  # scores of order one
    out = backend.forward(0, q, new_k, new_v, scale, backend.build_metadata(batch, cache))
    errors = []
    for row in range(4):
        start, n = int(batch.query_starts[row]), queries[row]
        expected = naive_attention(q[start : start + n], *history[row], scale)
        errors.append((out[start : start + n] - expected).abs().max().item() / value_spread)
    return max(errors)


@pytest.fixture
def torch_rounding_under_the_interpreter(monkeypatch):
    """Triton's interpreter rounds fp32 to fp8 wrongly where rounding up carries past a power
    of two (1.95 becomes 1.0 in e4m3, not 2.0; compiled kernels round in hardware). Where the
    kernels are interpreted, the Triton backend stores K/V through the torch path instead, so
    that a comparison checks the scales and the reads, not the interpreter's rounding. The
    store kernel's division and saturation are checked on exactly representable values
    (`tests/attention/test_triton_attention.py`)."""
    if triton_paged.interpreted():
        monkeypatch.setattr(TritonPagedAttention, "_store", TorchPagedAttention._store)


SCALED_BACKENDS = [
    ("torch", "cpu"),
    pytest.param("triton", TRITON_DEVICE, marks=needs_triton),
    pytest.param("torch", CUDA.values[0], marks=CUDA.marks),
]


@pytest.mark.usefixtures("torch_rounding_under_the_interpreter")
@pytest.mark.parametrize(("backend_name", "device"), SCALED_BACKENDS)
def test_calibrated_scales_keep_attention_close_where_scales_of_one_do_not(backend_name, device):
    assert scaled_step(backend_name, device, calibrated=True) < 0.25
    assert scaled_step(backend_name, device, calibrated=False) > 0.6


# --- the engine: checkpoint scales, calibration on the first step ---------------------


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def test_the_first_step_calibrates_every_layer_once():
    """After the first step (one prompt) each layer's largest stored |K| is what KEY_RANGE
    rounds to in the cache's format, and |V| VALUE_RANGE's; later steps keep the scales."""
    core, _ = tiny_core(
        kv_cache_dtype="fp8_e5m2", attention_backend="torch", calculate_kv_scales=True
    )
    cache = core.runner.kv_cache
    assert cache.calibrating
    core.add_request("first", PROMPTS[1], greedy())
    core.step()
    assert not cache.calibrating
    for layer in range(cache.spec.num_layers):
        assert cache.key(layer).float().abs().max().item() == fp8(KEY_RANGE, E5M2)
        assert cache.value(layer).float().abs().max().item() == fp8(VALUE_RANGE, E5M2)
    scales = cache.scales.clone()
    assert not torch.equal(scales, torch.ones_like(scales))
    while core.has_unfinished():
        core.step()
    run_all(core, PROMPTS, greedy())
    assert torch.equal(cache.scales, scales)


@needs_triton
@pytest.mark.usefixtures("torch_rounding_under_the_interpreter")
def test_backends_agree_over_a_calibrated_cache():
    """The Triton kernels (interpreted without a GPU) and the torch oracle calibrate the same
    scales, store the same bytes and read them back alike."""
    runs = {}
    for backend in ("torch", "triton"):
        core, _ = tiny_core(
            device=TRITON_DEVICE,
            kv_cache_dtype="fp8_e5m2",
            attention_backend=backend,
            calculate_kv_scales=True,
            block_size=16,
        )
        runs[backend] = (run_all(core, PROMPTS, greedy()), core.runner.kv_cache.scales.cpu())
    (torch_out, torch_scales), (triton_out, triton_scales) = runs["torch"], runs["triton"]
    torch.testing.assert_close(triton_scales, torch_scales)
    assert_agree(triton_out, torch_out, len(PROMPTS))


def save_with_scales(folder, scales: list[tuple[float, float]]) -> None:
    model = tiny_llama()
    model.save_pretrained(folder)
    weights = load_file(str(folder / "model.safetensors"))
    for layer, (k, v) in enumerate(scales):
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_the_checkpoint_scales_reach_the_cache(tmp_path, caplog):
    save_with_scales(tmp_path, [(0.02, 0.01), (0.03, 0.005)])
    with caplog.at_level(logging.INFO):
        core, _ = tiny_core(
            kv_cache_dtype="fp8_e5m2", attention_backend="torch", model_path=str(tmp_path)
        )
    cache = core.runner.kv_cache
    expected = torch.tensor([[0.02, 0.01], [0.03, 0.005]])
    torch.testing.assert_close(cache.scales, expected)
    assert not cache.calibrating
    assert "KV cache float8_e5m2 (scales from the checkpoint)" in caplog.text
    outputs = run_all(core, PROMPTS, greedy())
    assert all(len(tokens_of(outputs[f"req-{i}"])) == 8 for i in range(len(PROMPTS)))
    torch.testing.assert_close(cache.scales, expected)


@needs_cpu_kernels
def test_the_cpu_kernels_keep_fp8_unscaled_and_say_so(tmp_path, caplog):
    save_with_scales(tmp_path, [(0.02, 0.01), (0.03, 0.005)])
    with caplog.at_level(logging.WARNING):
        core, _ = tiny_core(
            kv_cache_dtype="fp8_e5m2", attention_backend="cpu", model_path=str(tmp_path)
        )
    cache = core.runner.kv_cache
    assert torch.equal(cache.scales, torch.ones_like(cache.scales))
    assert "the cpu attention backend stores fp8 K/V unscaled" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        core, _ = tiny_core(kv_cache_dtype="bfloat16", calculate_kv_scales=True)
    assert not core.runner.kv_cache.calibrating
    assert "--calculate-kv-scales applies to fp8 KV caches only" in caplog.text


@needs_triton
def test_the_calibrating_step_runs_eagerly_and_graphs_read_the_new_scales():
    """Decode graphs built before calibration: the first step (a one-token prompt, a decode
    step in shape) runs eagerly; later decode steps go through the graphs over the calibrated
    scales and give the same tokens as a core without graphs."""

    def run(graphs: bool) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
        core, _ = tiny_core(
            device=TRITON_DEVICE,
            kv_cache_dtype="fp8_e5m2",
            attention_backend="triton",
            calculate_kv_scales=True,
            block_size=16,
            max_num_seqs=4,
            enforce_eager=True,
        )
        runner, padded = core.runner, []
        if graphs:
            runner.graphs = DecodeGraphs(
                runner.model, runner.backend, runner.kv_cache, max_num_seqs=4, max_model_len=512
            )
            padded = spy_padding(runner.graphs)
        core.add_request("one-token", [9], greedy())
        outputs = {"one-token": list(core.step())}
        assert not runner.kv_cache.calibrating
        assert padded == []  # the calibrating step ran eagerly
        core.add_request("later", [5, 9, 33, 2, 7, 8], greedy())
        outputs["later"] = []
        while core.has_unfinished():
            for output in core.step():
                outputs[output.request_id].append(output)
        return {name: tokens_of(o) for name, o in outputs.items()}, padded

    graphed, padded = run(graphs=True)
    assert padded  # decode steps went through the graphs after calibration
    assert graphed == run(graphs=False)[0]


@pytest.mark.parametrize("device", [CUDA])
def test_captured_graphs_read_scales_calibrated_after_capture(device):
    """On a GPU the decode graphs are captured at start-up, before the first step calibrates
    the scales: replays read the new scales, so tokens equal those of an eager core."""
    outputs = {}
    for eager in (False, True):
        core, _ = tiny_core(
            device=device,
            kv_cache_dtype="fp8_e5m2",
            calculate_kv_scales=True,
            block_size=16,
            max_num_seqs=8,
            enforce_eager=eager,
        )
        assert (core.runner.graphs is None) == eager
        outputs[eager] = run_all(core, PROMPTS, greedy())
    for i in range(len(PROMPTS)):
        assert tokens_of(outputs[False][f"req-{i}"]) == tokens_of(outputs[True][f"req-{i}"])
