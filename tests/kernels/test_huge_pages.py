"""Weights and the KV cache in huge pages: values kept, every holder repointed, and nothing moved
where the kernel declines the advice."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.kernels.cpu import huge_pages
from engine.kv.kv_cache import KVCache, KVCacheSpec
from tests.helpers import reference_greedy, run_all, tiny_core, tiny_llama, tokens_of

MIB = 1024 * 1024


class FakeAdvice:
    """Records where huge pages were asked for (address, length) and answers as told."""

    def __init__(self, taken: bool) -> None:
        self.taken = taken
        self.calls: list[tuple[int, int]] = []

    def __call__(self, memory: mmap.mmap, offset: int, length: int) -> bool:
        base = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
        self.calls.append((base + offset, length))
        return self.taken


@pytest.fixture
def madvise(monkeypatch: pytest.MonkeyPatch) -> FakeAdvice:
    fake = FakeAdvice(True)
    monkeypatch.setattr(huge_pages, "_advise", fake)
    return fake


def some_weights() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(700, 512),
        torch.randn(33).to(torch.bfloat16),
        torch.randint(-128, 127, (1024, 1030), dtype=torch.int8),
    ]


def test_move_keeps_values_and_repoints_every_holder(madvise: FakeAdvice) -> None:
    tensors = some_weights()
    before = [t.clone() for t in tensors]
    held = {"first": tensors[0]}
    moved = huge_pages.move_into_huge_pages(tensors)
    assert moved >= sum(t.nbytes for t in tensors)
    ((address, length),) = madvise.calls
    assert address % huge_pages.HUGE_PAGE == 0 and length % huge_pages.HUGE_PAGE == 0
    starts = sorted(t.data_ptr() for t in tensors)
    assert starts[0] == address
    assert all(start % huge_pages.ALIGNMENT == 0 for start in starts)
    for tensor, old in zip(tensors, before, strict=True):
        assert tensor.dtype == old.dtype and torch.equal(tensor, old)
    assert held["first"].data_ptr() == address
    assert held["first"].untyped_storage().data_ptr() == tensors[1].untyped_storage().data_ptr()


def test_tensors_shared_twice_move_once(madvise: FakeAdvice) -> None:
    weight = torch.randn(1024, 1024)
    moved = huge_pages.move_into_huge_pages([weight, weight])
    assert moved == weight.nbytes
    assert weight.data_ptr() == madvise.calls[0][0]


def test_views_of_one_weight_stay_views_of_one_copy(madvise: FakeAdvice) -> None:
    """A fused weight and the views other modules hold of its parts (some strided) move as
    one span: one copy, every view at the same place in it."""
    fused = torch.randn(2, 1024, 512)
    first, second, strided = fused[0], fused[1], fused[:, 3]
    expected = [t.clone() for t in (fused, first, second, strided)]
    moved = huge_pages.move_into_huge_pages([first, fused, strided, second])
    assert moved == fused.nbytes
    storage = fused.untyped_storage().data_ptr()
    assert storage == madvise.calls[0][0]
    for tensor, old in zip((fused, first, second, strided), expected, strict=True):
        assert tensor.untyped_storage().data_ptr() == storage
        assert torch.equal(tensor, old)
    assert second.data_ptr() == fused.data_ptr() + fused[0].nbytes
    fused[1, 0, 0] = 7.0  # still one memory
    assert second[0, 0] == 7.0


def test_declined_advice_moves_nothing(madvise: FakeAdvice) -> None:
    madvise.taken = False
    tensors = some_weights()
    pointers = [t.data_ptr() for t in tensors]
    assert huge_pages.move_into_huge_pages(tensors) == 0
    assert [t.data_ptr() for t in tensors] == pointers


def test_small_tensors_stay(madvise: FakeAdvice) -> None:
    small = torch.randn(64)
    pointer = small.data_ptr()
    assert huge_pages.move_into_huge_pages([small]) == 0
    assert small.data_ptr() == pointer and not madvise.calls


def test_zeros_in_huge_pages(madvise: FakeAdvice) -> None:
    zeros = huge_pages.zeros((3, 2, 1000, 512), torch.bfloat16)
    assert zeros.shape == (3, 2, 1000, 512) and zeros.dtype == torch.bfloat16
    assert zeros.is_contiguous() and not zeros.any()
    assert zeros.data_ptr() == madvise.calls[0][0]
    madvise.taken = False
    plain = huge_pages.zeros((4, 5), torch.float32)
    assert plain.shape == (4, 5) and not plain.any()


def test_cpu_kv_cache_is_zeroed_in_huge_pages(madvise: FakeAdvice) -> None:
    spec = KVCacheSpec(
        num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16
    )
    cache = KVCache(spec, 512, torch.device("cpu"))
    assert cache.tensor.data_ptr() == madvise.calls[0][0]
    assert cache.tensor.shape == (2, 2, 512, 16, 2, 64) and not cache.tensor.any()
    assert cache.key(1).data_ptr() > cache.tensor.data_ptr()


def thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else "absent"


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    return smaps_kib(address, "AnonHugePages")


def smaps_kib(address: int, field: str) -> int:
    """A field (KiB) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(
    thp_mode() not in ("always", "madvise"),
    reason="this kernel hands out no transparent huge pages",
)
def test_a_fresh_kv_cache_takes_memory_as_its_blocks_are_written() -> None:
    """Nothing of a 64 MiB cache is resident before a step writes it (its pages are not all
    faulted in at start-up); a block written takes its pages, and the rest read as zero."""
    spec = KVCacheSpec(
        num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=16
    )
    cache = KVCache(spec, 64 * MIB // spec.bytes_per_block, torch.device("cpu"))
    address = cache.tensor.data_ptr()
    assert smaps_kib(address, "Rss") < 4 * 1024
    cache.key(1)[3].fill_(1.0)
    assert 2 * 1024 <= smaps_kib(address, "Rss") < 8 * 1024
    assert int(cache.key(1)[3].sum()) == cache.key(1)[3].numel()
    assert not cache.key(0).any() and not cache.key(1)[4:].any()


@pytest.mark.skipif(
    thp_mode() not in ("always", "madvise"),
    reason="this kernel hands out no transparent huge pages",
)
def test_the_kernel_backs_moved_weights_with_huge_pages() -> None:
    weight = torch.randn(4 * MIB // 4 * 4)
    expected = weight.clone()
    assert huge_pages.move_into_huge_pages([weight]) > 0
    assert torch.equal(weight, expected)
    assert anon_huge_kib(weight.data_ptr()) >= 2048


def test_engine_weights_move_and_greedy_still_matches(madvise: FakeAdvice) -> None:
    model = tiny_llama(vocab_size=8192)
    prompt = [5, 77, 1000, 4096, 9, 8000]
    expected = reference_greedy(model, prompt, 8)
    core, _ = tiny_core(model)
    weights_call = madvise.calls[-1]
    start, end = weights_call[0], weights_call[0] + weights_call[1] + huge_pages.HUGE_PAGE
    runner_model = core.runner.model
    assert all(start <= p.data_ptr() < end for p in runner_model.parameters())
    outputs = run_all(core, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert tokens_of(outputs["req-0"]) == expected
