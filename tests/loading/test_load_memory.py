"""A 16-bit model's linear layers take their CPU forms one layer at a time, each widened alone:
the panels are those the model widened to fp32 whole would give, the rest of the model is
fp32 as before, and the process never holds the model's weights twice (`model.float()` first
held them in fp32 beside the 16-bit copy, and the swapped-out weights stayed in the heap)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.kernels.cpu import malloc_tuning
from engine.kernels.cpu.linear import CPU_LINEAR_TYPES, PanelLinear, convert_linears
from engine.kernels.cpu.ops import bf16_panels_available
from engine.loading import gguf_blocks
from engine.loading.model_loader import LinearForm, use_linear_form
from tests.helpers import needs_panels, tiny_llama

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def half_form(dtype: torch.dtype) -> LinearForm:
    """The 16-bit form a `dtype` model takes on this CPU's kernels."""
    bf16 = dtype == torch.bfloat16 and bf16_panels_available()
    return LinearForm.BF16_PANELS if bf16 else LinearForm.HALF_WEIGHTS


@needs_panels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_layer_widens_alone_to_the_panels_of_the_model_widened_whole(
    dtype: torch.dtype,
) -> None:
    """Every panel equals the panel made from the model widened to fp32 first (the former
    route), and every other parameter and buffer (the tied embedding, the norms) is fp32 and
    equal to the widened model's."""
    model = tiny_llama(dtype=dtype, tie_word_embeddings=True)
    widened = tiny_llama(dtype=dtype, tie_word_embeddings=True).float()
    convert_linears(widened, dtype)
    use_linear_form(model, half_form(dtype))
    ours, theirs = dict(model.named_modules()), dict(widened.named_modules())
    layers = {name for name, m in ours.items() if isinstance(m, CPU_LINEAR_TYPES)}
    assert len(layers) == 7 * model.config.num_hidden_layers + 1
    for name in layers:
        assert type(ours[name]) is type(theirs[name]), name
        if isinstance(ours[name], PanelLinear):
            assert torch.equal(ours[name].panels, theirs[name].panels), name
    rest = dict([*widened.named_parameters(), *widened.named_buffers()])
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.rpartition(".")[0] not in layers:
            assert tensor.dtype == torch.float32, name
            assert torch.equal(tensor, rest[name]), name


def peak_since_reset() -> int:
    return _status("VmHWM")


def _status(key: str) -> int:
    for line in STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> int:
    """Reset this process's peak resident memory to its resident memory now; return it."""
    CLEAR_REFS.write_text("5")
    return _status("VmRSS")


def peaks_resettable() -> str:
    """Why the peak cannot be measured here ("" where it can): not Linux, or clear_refs shut."""
    try:
        reset_peak()
    except (OSError, KeyError) as exc:
        return f"this machine cannot reset a process's peak memory: {exc}"
    return ""


NO_PEAKS = peaks_resettable()


@needs_panels
@pytest.mark.skipif(bool(NO_PEAKS), reason=NO_PEAKS or "-")
def test_a_16_bit_model_takes_its_panels_without_holding_its_weights_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Taking the panels of a bf16 model of 64 MiB of linear weights raises the process's peak
    by less than half of them (widening the model first raised it by more than twice them)."""
    monkeypatch.setattr(malloc_tuning, "GIVE_BACK_EVERY", 8 * 1024 * 1024)
    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    linear = sum(m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear >= 64 * 2**20
    malloc_tuning.give_back_freed_memory()
    before = reset_peak()
    use_linear_form(model, half_form(torch.bfloat16))
    grew = peak_since_reset() - before
    assert grew < linear / 2, (grew, linear)


def test_dequantized_rows_are_the_blocks_weights_computed_apart() -> None:
    """In place, the weight is still d * q + m of each block (Q6_K: a scale per 16 inputs),
    equal to the bit to the products computed out of place."""
    generator = torch.Generator().manual_seed(0)
    for fmt in (gguf_blocks.Q4_1, gguf_blocks.Q6_K, gguf_blocks.Q8_0):
        width = 2 * fmt.block
        rows = torch.randint(0, 256, (8, width // fmt.block * fmt.block_bytes), generator=generator)
        rows = rows.to(torch.uint8)
        if fmt is gguf_blocks.Q6_K:  # finite fp16 d in the last two bytes of each super-block
            rows.view(8, -1, fmt.block_bytes)[..., 208:210] = torch.tensor([0, 0x3C]).to(
                torch.uint8
            )
        else:  # finite fp16 scales
            rows.view(8, -1, fmt.block_bytes)[..., 1] = 0x3C
            if fmt.has_min:
                rows.view(8, -1, fmt.block_bytes)[..., 3] = 0x3C
        d, m, q = gguf_blocks.split_rows(fmt, rows)
        scales = d.float()
        per_input = (
            scales.unsqueeze(-1)
            if scales.dim() == 2
            else scales.repeat_interleave(32 // scales.shape[-1], dim=-1)
        )
        expected = per_input * q.float()
        if m is not None:
            expected = expected + m.float().unsqueeze(-1)
        assert torch.equal(gguf_blocks.dequantize_rows(fmt, rows), expected.reshape(8, -1))


@needs_panels
def test_an_image_text_model_widens_its_language_model_and_head_only() -> None:
    """A LLaVA in bf16: the language model's layers and the head take panels and its other
    tensors fp32; the vision tower keeps bf16 weights and torch's own layers."""
    from tests.vision_utils import tiny_llava

    model = tiny_llava().to(torch.bfloat16)
    use_linear_form(model, half_form(torch.bfloat16))
    assert isinstance(model.get_output_embeddings(), CPU_LINEAR_TYPES)
    decoder = model.get_decoder()
    assert not any(type(m) is torch.nn.Linear for m in decoder.modules())
    assert all(p.dtype == torch.float32 for p in decoder.parameters())
    tower = model.model.vision_tower
    assert any(type(m) is torch.nn.Linear for m in tower.modules())
    assert all(p.dtype == torch.bfloat16 for p in tower.parameters())
