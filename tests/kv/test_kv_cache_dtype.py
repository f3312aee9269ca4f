"""A 16-bit or fp8 KV cache under fp32 compute (`--kv-cache-dtype`): what the cache holds, how
`auto` resolves, and that attention over it stays consistent and close to the fp32 cache."""

from __future__ import annotations

import pytest
import torch

from engine import factory
from engine.core.config import CacheConfig
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.factory import cache_dtype_named, kv_cache_dtype
from engine.kernels.cpu.linear import pack_linears
from server.cli import build_parser, engine_config
from tests.helpers import reference_greedy, run_all, tiny_core, tiny_llama, tokens_of

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16, F16, FP8 = torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2
E4M3 = torch.float8_e4m3fn
PROMPTS = [[5, 9, 33, 2], list(range(40, 120)), [7] * 13]


@pytest.mark.parametrize(
    ("name", "model", "compute", "device", "expected"),
    [
        ("auto", F32, F32, CPU, F32),
        ("auto", BF16, F32, CPU, BF16),  # a bf16 model on a CPU without native bf16
        ("auto", BF16, BF16, CUDA, BF16),
        ("float16", F32, F32, CPU, F16),
        ("bfloat16", BF16, BF16, CPU, BF16),
        ("float32", BF16, F32, CPU, F32),
        ("fp8_e5m2", F32, F32, CPU, FP8),
        ("fp8_e5m2", BF16, F32, CPU, FP8),
        # On CUDA the Triton kernels (and torch's casts) read fp8 under any compute dtype.
        ("fp8", BF16, BF16, CUDA, E4M3),
        ("fp8_e4m3", F16, F16, CUDA, E4M3),
        ("fp8_e5m2", BF16, BF16, CUDA, FP8),
    ],
)
def test_what_the_cache_holds(
    name: str,
    model: torch.dtype,
    compute: torch.dtype,
    device: torch.device,
    expected: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(factory, "_capability", lambda device: (9, 0))  # a Hopper GPU
    assert kv_cache_dtype(name, model, compute, device) == expected


def test_e4m3_needs_a_gpu_that_converts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before compute capability 8.9 (an A100 is 8.0) there are no e4m3 conversions: the
    Triton kernels do not compile (`engine.kernels.triton.targets`); e5m2 is the way there."""
    monkeypatch.setattr(factory, "_capability", lambda device: (8, 0))
    with pytest.raises(ValueError, match=r"8\.9 or newer.*fp8_e5m2"):
        kv_cache_dtype("fp8", BF16, BF16, CUDA)
    assert kv_cache_dtype("fp8_e5m2", BF16, BF16, CUDA) == FP8


@pytest.mark.parametrize(
    ("name", "model", "compute", "device"),
    [
        ("float32", BF16, BF16, CPU),  # wider than the compute dtype
        ("float16", BF16, BF16, CUDA),
        ("bfloat16", F32, F32, CUDA),  # the GPU kernels read the compute dtype only
        ("fp8_e5m2", BF16, BF16, CPU),  # the CPU kernels widen it under fp32 compute only
        ("fp8_e4m3", F32, F32, CPU),  # and e5m2 only
    ],
)
def test_unsupported_combinations_are_refused(
    name: str, model: torch.dtype, compute: torch.dtype, device: torch.device
) -> None:
    with pytest.raises(ValueError, match="KV cache under"):
        kv_cache_dtype(name, model, compute, device)


def test_flag_and_config() -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "float16"])
    assert engine_config(args).cache.dtype == "float16"
    assert engine_config(build_parser().parse_args(["serve"])).cache.dtype == "auto"
    fp8 = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e5m2"])
    assert engine_config(fp8).cache.dtype == "fp8_e5m2"
    vllm_name = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert cache_dtype_named(engine_config(vllm_name).cache.dtype) == E4M3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e4m2"])
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        CacheConfig(dtype="int8")


@pytest.mark.parametrize("dtype", [FP8, E4M3])
def test_an_fp8_cache_saturates_what_it_stores(dtype: torch.dtype) -> None:
    from engine.kv.kv_cache import KVCache, KVCacheSpec

    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=dtype, block_size=2)
    cache = KVCache(spec, num_blocks=2, device=CPU)
    row = torch.tensor([[[1e6, -1e6, 2.0, -0.5]]])
    cache.write(0, torch.tensor([3]), row, row)
    largest = torch.finfo(dtype).max
    assert cache.key(0)[1, 1, 0].float().tolist() == [largest, -largest, 2.0, -0.5]


def test_the_same_budget_holds_twice_the_blocks() -> None:
    full = tiny_core(num_blocks=None, kv_cache_memory=1 << 20)[0].runner.kv_cache
    half = tiny_core(num_blocks=None, kv_cache_memory=1 << 20, kv_cache_dtype="bfloat16")[
        0
    ].runner.kv_cache
    quarter = tiny_core(num_blocks=None, kv_cache_memory=1 << 20, kv_cache_dtype="fp8_e5m2")[
        0
    ].runner.kv_cache
    assert (full.tensor.dtype, half.tensor.dtype, quarter.tensor.dtype) == (F32, BF16, FP8)
    assert half.num_blocks == 2 * full.num_blocks
    assert quarter.num_blocks == 4 * full.num_blocks


def greedy_with_logprobs(
    kv: str, backend: str, prompts: list[list[int]], packed: bool = False
) -> dict[str, list[RequestOutput]]:
    model = tiny_llama()
    if packed:
        pack_linears(model)
    core, _ = tiny_core(model, kv_cache_dtype=kv, attention_backend=backend)
    assert core.runner.kv_cache.tensor.dtype == cache_dtype_named(kv)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    return run_all(core, prompts, params)


def chosen_logprobs(outputs: list[RequestOutput]) -> list[float]:
    return [entry.logprob for o in outputs for entry in o.logprobs]


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_over_a_16_bit_cache_equals_generate(kv: str, backend: str) -> None:
    """Rounding K/V to 16 bits moves logprobs a little and, on these well-separated logits,
    no greedy choice."""
    expected = [reference_greedy(tiny_llama(), p, 10) for p in PROMPTS]
    rounded = greedy_with_logprobs(kv, backend, PROMPTS)
    exact = greedy_with_logprobs("float32", backend, PROMPTS)
    for i in range(len(PROMPTS)):
        assert tokens_of(rounded[f"req-{i}"]) == expected[i]
        torch.testing.assert_close(
            torch.tensor(chosen_logprobs(rounded[f"req-{i}"])),
            torch.tensor(chosen_logprobs(exact[f"req-{i}"])),
            atol=0.05,
            rtol=0.0,
        )


@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e5m2"])
@pytest.mark.parametrize("packed", [False, True], ids=["op_by_op", "fused_layers"])
def test_narrow_cache_backends_agree(kv: str, packed: bool) -> None:
    """The C++ kernel (fused layers too, with panel weights) and the pure-torch oracle read the
    same rounded K/V: their logprobs agree to fp32 accuracy."""
    cpu = greedy_with_logprobs(kv, "cpu", PROMPTS, packed)
    oracle = greedy_with_logprobs(kv, "torch", PROMPTS, packed)
    assert_agree(cpu, oracle, len(PROMPTS))


def assert_agree(ours: dict[str, list[RequestOutput]], theirs: dict, count: int) -> None:
    """Requests `req-0` ... of two runs chose the same tokens with logprobs equal to fp32
    accuracy."""
    for i in range(count):
        assert tokens_of(ours[f"req-{i}"]) == tokens_of(theirs[f"req-{i}"])
        torch.testing.assert_close(
            torch.tensor(chosen_logprobs(ours[f"req-{i}"])),
            torch.tensor(chosen_logprobs(theirs[f"req-{i}"])),
            atol=1e-4,
            rtol=1e-4,
        )


@pytest.mark.parametrize(
    ("backend", "kv", "scaled"),
    [
        *[(backend, kv, False) for backend in ("cpu", "torch") for kv in ("bfloat16", "fp8_e5m2")],
        ("torch", "fp8_e5m2", True),  # scales calibrated on the first step
    ],
)
def test_a_prompt_attends_alike_fresh_and_from_the_prefix_cache(
    backend: str, kv: str, scaled: bool
) -> None:
    """A fresh prompt attends over its new K/V rounded as the cache holds them (divided by the
    layer's scales and back, where it has some), so a second request that reads the first
    one's blocks from the prefix cache gets the same logprobs."""
    prompt = list(range(40, 80))
    model = tiny_llama()
    core, _ = tiny_core(
        model, kv_cache_dtype=kv, attention_backend=backend, calculate_kv_scales=scaled
    )
    scales = core.runner.kv_cache.scales
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    first = run_all(core, [prompt], params)["req-0"]
    core.add_request("again", prompt, params)
    second: list[RequestOutput] = []
    while core.has_unfinished():
        second.extend(o for o in core.step() if o.request_id == "again")
    assert second[-1].num_cached_tokens > 0
    assert torch.equal(scales, torch.ones_like(scales)) != scaled
    assert tokens_of(second) == tokens_of(first)
    torch.testing.assert_close(
        torch.tensor(chosen_logprobs(second)),
        torch.tensor(chosen_logprobs(first)),
        atol=1e-5,
        rtol=1e-5,
    )
