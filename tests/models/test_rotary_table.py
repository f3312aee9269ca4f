from __future__ import annotations

import pytest
import torch

from engine.models.rotary_table import AxisRotary, RotaryTable, rotary_axes
from tests.helpers import tiny_llama
from tests.vision_utils import tiny_image_text


def _module(rotary, x, positions):
    cos, sin = rotary(x, positions[None])
    return cos[0, :, None, :], sin[0, :, None, :]


def _rotary(**overrides):
    model = tiny_llama(max_positions=4096, **overrides)
    return model.model.rotary_emb, model.config.max_position_embeddings


def test_rows_equal_the_modules_answer_for_any_batch_of_positions():
    rotary, max_positions = _rotary()
    table = RotaryTable(rotary, max_positions)
    assert table.enabled
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, dtype=dtype)
        # Within the first rows, then past them (the table grows), in any order.
        for tokens, top in ((1, 10), (3, 700), (17, 1024), (64, 3000), (5, 4096)):
            positions = torch.randint(0, top, (tokens,), generator=generator)
            cos, sin = table(x, positions)
            want_cos, want_sin = _module(rotary, x, positions)
            assert cos.dtype == dtype and cos.shape == want_cos.shape
            assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert table.enabled


def test_positions_past_the_models_length_ask_the_module():
    rotary, _ = _rotary()
    calls = []

    def counted(x, positions):
        calls.append(positions.shape[1])
        return rotary(x, positions)

    counted.rope_type = rotary.rope_type
    counted.inv_freq = rotary.inv_freq
    table = RotaryTable(counted, max_positions=64)
    x = torch.zeros(1)
    table(x, torch.arange(8))
    made = len(calls)
    cos, _ = table(x, torch.tensor([3, 64]))
    assert len(calls) == made + 1 and calls[-1] == 2
    assert torch.equal(cos, _module(rotary, x, torch.tensor([3, 64]))[0])


def test_frequencies_that_change_with_the_length_ask_the_module_every_step():
    rotary, max_positions = _rotary(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert not RotaryTable(rotary, max_positions).enabled


class _BatchDependent:
    """A rotary whose rows depend on the batch they come in: no table can stand for it."""

    rope_type = "default"
    inv_freq = torch.ones(8)

    def __call__(self, x, positions):
        angles = positions[..., None].float() / positions.shape[-1] * torch.ones(16)
        return angles.cos(), angles.sin()


def test_a_table_that_disagrees_with_the_module_is_dropped():
    rotary = _BatchDependent()
    table = RotaryTable(rotary, max_positions=4096)
    positions = torch.tensor([5, 9, 30])
    cos, sin = table(torch.zeros(1), positions)
    assert not table.enabled
    want_cos, want_sin = _module(rotary, torch.zeros(1), positions)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_positions_on_three_axes_equal_the_modules_answer(family):
    """Qwen2.5-VL's sections and Qwen3-VL's interleaved frequencies, looked up per axis."""
    language = tiny_image_text(family).model.language_model
    rotary = language.rotary_emb
    axes = rotary_axes(language.config)
    assert axes is not None
    looked_up = AxisRotary(RotaryTable(rotary, 512), axes)
    positions = torch.randint(0, 300, (3, 23), generator=torch.Generator().manual_seed(1))
    x = torch.zeros(1)
    cos, sin = looked_up(x, positions)
    want_cos, want_sin = rotary(x, positions[:, None])
    assert torch.equal(cos[:, 0], want_cos[0]) and torch.equal(sin[:, 0], want_sin[0])
    # The same position on every axis is the one-axis table's.
    same = looked_up(x, positions[0].expand(3, -1))[0]
    assert torch.equal(same, looked_up(x, positions[0])[0])
