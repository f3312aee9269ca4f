"""Images on their grids (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5): rotary positions on three axes
equal transformers' own, beside text requests in the same steps and from the prefix cache; a
prompt whose placeholders do not fit its images is refused; the processor loads without its
video half; Qwen3-VL's tower feeds its first decoder layers, on Conveyor's decoder only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.core.errors import InvalidRequestError
from engine.core.images import ImageInputs
from engine.core.mrope import grid_positions
from engine.loading.processors import load_processor
from tests.helpers import tokens_of
from tests.models.test_image_text import GREEDY, image_text_core, run, submit
from tests.vision_utils import (
    QWEN_VL_FAMILIES,
    image_prompt,
    random_image,
    reference_tokens,
    save_tiny,
)
from tests.vision_utils import tiny_image_text as tiny

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]
# Qwen3.5's language models, whose linear attention keeps states: a cached prefix resumes from a
# snapshot of them, kept here every two blocks.
STATEFUL = {"qwen3_5": {"mamba_block_size": 8}, "qwen3_5_moe": {"mamba_block_size": 8}}
# Three grids: 4x6 cells, 6x2 (tall) and 2x2 (the smallest), with text between.
PARTS = [
    "Hello",
    random_image(2),
    "and",
    random_image(3, width=24, height=90),
    random_image(4, width=20, height=20),
    "there",
]


@pytest.mark.parametrize("family", FAMILIES)
def test_grid_positions_equal_transformers_rope_index(family):
    processed, ids, images = image_prompt(PARTS, family)
    grids = processed["image_grid_thw"].tolist()
    assert len({tuple(g) for g in grids}) == 3
    found = grid_positions(len(ids), images.runs(), grids, merge=2)
    model = tiny(family)
    expected, delta = model.model.get_rope_index(
        processed["input_ids"], processed["mm_token_type_ids"], processed["image_grid_thw"]
    )
    assert np.array_equal(found.prompt, expected[:, 0].numpy())
    assert found.delta == int(delta)
    # A chunk across the prompt's end: its prompt part, then each later token at i + delta.
    later = found.of(len(ids) - 2, len(ids) + 3)
    assert np.array_equal(later[:, :2], found.prompt[:, -2:])
    assert np.array_equal(later[:, 2:], np.tile(np.arange(3) + len(ids) + found.delta, (3, 1)))


def test_a_run_that_does_not_hold_its_grid_is_refused():
    core = image_text_core("qwen2_vl")
    _, ids, images = image_prompt(PARTS, "qwen2_vl")
    short = ImageInputs(images.positions[:-1], images.starts, dict(images.data))
    with pytest.raises(InvalidRequestError, match="placeholders"):
        core.add_request("short", ids, GREEDY, images=short)
    missing = ImageInputs(images.positions, images.starts, {"pixel_values": 0})
    with pytest.raises(InvalidRequestError, match="no image grids"):
        core.add_request("missing", ids, GREEDY, images=missing)
    assert core.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_text_and_image_requests_share_steps_and_the_cache(family):
    """A text request beside image requests (the step's positions on three axes for some rows,
    one for the other), then the same image turn again from the prefix cache."""
    core = image_text_core(
        family, block_size=4, max_num_batched_tokens=16, **STATEFUL.get(family, {})
    )
    assert core.runner.model.sparse == family.endswith("_moe")  # its experts, Conveyor's
    text = core.tokenizer("Paged attention stores keys and values.")["input_ids"]
    core.add_request("text", text, GREEDY)
    first, _ = submit(core, "first", PARTS, family)
    outputs = run(core)
    model = tiny(family)
    assert tokens_of(outputs["text"]) == reference_tokens(
        model, {"input_ids": torch.tensor([text])}, 8
    )
    assert tokens_of(outputs["first"]) == reference_tokens(model, first, 8)
    submit(core, "again", PARTS, family)
    repeat = run(core)["again"]
    assert repeat[-1].num_cached_tokens >= 32
    assert tokens_of(repeat) == tokens_of(outputs["first"])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_processor_loads_without_its_video_half(tmp_path, family):
    """As `conveyor serve --model` loads it (here without torchvision, its image half alone):
    the folder names transformers' own class, and the loaded processor gives the same inputs."""
    folder = save_tiny(tmp_path / family, family)
    loaded = load_processor(str(folder), family)
    assert type(loaded).__name__ == QWEN_VL_FAMILIES[family].__name__
    processed, _, _ = image_prompt(PARTS, family)
    text = loaded.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "image"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    again = loaded(text=[text], images=[PARTS[1]], return_tensors="pt")
    assert torch.equal(
        again["pixel_values"], processed["pixel_values"][: len(again["pixel_values"])]
    )
    assert again["image_grid_thw"].tolist() == processed["image_grid_thw"][:1].tolist()


def test_qwen3_vl_feeds_its_first_layers_and_refuses_transformers_model():
    """Without the rows its tower feeds the first decoder layers the tokens are not
    transformers'; its model whole cannot take them, so `--model-impl transformers` is refused."""
    core = image_text_core("qwen3_vl")
    processed, _ = submit(core, "r", PARTS, "qwen3_vl")
    width = tiny("qwen3_vl").config.text_config.hidden_size
    encode = core.runner.model.image_encoder
    core.runner.model.image_encoder = lambda data: encode(data)[:, :width]
    tokens = tokens_of(run(core)["r"])
    assert tokens != reference_tokens(tiny("qwen3_vl"), processed, 8)
    with pytest.raises(ValueError, match="Conveyor's model implementation only"):
        image_text_core("qwen3_vl", model_impl="transformers")
