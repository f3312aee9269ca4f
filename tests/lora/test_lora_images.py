"""Adapters of an image-text model's language model: greedy tokens under one equal PEFT's merged
model's `generate` over the same image prompt, beside base-model rows; an adapter that also
adapts the vision encoder is refused by name."""

from __future__ import annotations

import pytest

from engine.lora.adapter import LoRAError, load_adapter
from tests.helpers import tokens_of
from tests.lora.adapters import merged, save_adapter
from tests.models.test_image_text import GREEDY, image_text_core, run
from tests.vision_utils import image_prompt, random_image, reference_tokens, tiny_image_text

# The language model's projections only (a vision tower has q_proj and gate_proj too).
LANGUAGE = r".*language_model.*\.(q_proj|v_proj|o_proj|gate_proj|down_proj)"
PARTS = [random_image(1), "The quick brown fox"]


@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen2_5_vl"])
def test_an_adapter_of_the_language_model_equals_peft_merged(tmp_path, family):
    path = save_adapter(tmp_path / family, LANGUAGE, seed=3, base=lambda: tiny_image_text(family))
    core = image_text_core(family, enable_lora=True, lora_modules=(("lm", path),))
    processed, ids, images = image_prompt(PARTS, family)
    core.add_request("base", ids, GREEDY, images=images)
    _, _, again = image_prompt(PARTS, family)
    core.add_request("adapted", ids, GREEDY, images=again, lora=core.loras.get("lm"))
    outputs = run(core)
    base = tokens_of(outputs["base"])
    adapted = tokens_of(outputs["adapted"])
    assert base == reference_tokens(tiny_image_text(family), processed, 8)
    assert adapted == reference_tokens(merged(path, tiny_image_text(family)), processed, 8)
    assert adapted != base


def test_an_adapter_of_the_vision_encoder_is_refused(tmp_path):
    path = save_adapter(tmp_path / "all", ["q_proj"], seed=4, base=lambda: tiny_image_text("llava"))
    shapes = image_text_core("llava", enable_lora=True).runner.model.lora_shapes()
    with pytest.raises(LoRAError, match="vision encoder"):
        load_adapter(path, shapes, max_rank=16)
