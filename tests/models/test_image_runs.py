"""Image tokens that see their whole image both ways (Gemma 3): a step never ends inside an
image's run, its tokens attend up to the run's end on every attention backend, a cached prefix
may end inside a run, and an image longer than a step is refused. The tokens are transformers'
`generate`'s, which differ from those of causal image tokens."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.core.errors import InvalidRequestError
from engine.core.images import ImageInputs
from tests.conftest import TRITON_DEVICE, needs_triton
from tests.helpers import needs_cpu_kernels, tokens_of
from tests.models.test_image_text import GREEDY, image_text_core, run, submit
from tests.vision_utils import TOKENS_PER_IMAGE, image_prompt, random_image, reference_tokens
from tests.vision_utils import tiny_image_text as tiny

TWO_IMAGES = ["Hello", random_image(2), "and", random_image(3, width=60)]


def gemma3_core(**options):
    return image_text_core("gemma3", **options)


def both_ways(positions: list[int]) -> ImageInputs:
    inputs = ImageInputs(np.array(positions), (), {})
    inputs.both_ways = True
    return inputs


def test_a_chunk_stops_before_a_run_it_would_cut_and_limits_reach_the_run_end():
    images = both_ways([4, 5, 6, 7, 12, 13])
    assert images.whole_runs(0, 6) == 4  # would end inside 4..8: stops at 4
    assert images.whole_runs(0, 8) == 8
    assert images.whole_runs(4, 3) == 0  # the run waits for a step with room for it whole
    assert images.whole_runs(6, 2) == 2  # a cached prefix ended inside the run
    assert images.whole_runs(8, 5) == 4
    assert images.whole_runs(14, 1) == 1  # decoding
    assert images.key_limits(0, 4) is None
    assert images.key_limits(2, 10).tolist() == [2, 3, 7, 7, 7, 7, 8, 9]
    assert images.key_limits(6, 14).tolist() == [7, 7, 8, 9, 10, 11, 13, 13]
    with pytest.raises(ValueError, match="cut"):
        images.key_limits(0, 6)
    causal = ImageInputs(np.array([4, 5, 6, 7]), (), {})
    assert causal.whole_runs(0, 6) == 6 and causal.key_limits(0, 8) is None


def test_no_step_ends_inside_an_image_and_the_tokens_equal_generate(monkeypatch):
    budget = TOKENS_PER_IMAGE + 3
    core = gemma3_core(max_num_batched_tokens=budget)
    schedule, chunks = core.scheduler.schedule, []

    def recorded():
        output = schedule()
        chunks.extend((item.request.request_id, item.start, item.end) for item in output.scheduled)
        return output

    monkeypatch.setattr(core.scheduler, "schedule", recorded)
    processed, _ = submit(core, "two", TWO_IMAGES, "gemma3")
    outputs = run(core)
    assert tokens_of(outputs["two"]) == reference_tokens(tiny("gemma3"), processed, 8)
    runs = image_prompt(TWO_IMAGES, "gemma3")[2].runs()
    assert len(runs) == 2
    for _, _, end in chunks:
        assert not any(start < end < stop for start, stop in runs)
    # Some chunk stopped short of its budget before an image.
    assert any(end - start < budget and end in runs[:, 0] for _, start, end in chunks)


def test_image_tokens_that_attend_causally_give_other_tokens(monkeypatch):
    """The mask is what makes the tokens transformers': with the image tokens causal (as
    transformers computes them without `token_type_ids`) the tokens are those, and differ."""
    core = gemma3_core()
    monkeypatch.setattr(core.runner, "images_both_ways", False)
    processed, _ = submit(core, "r", TWO_IMAGES, "gemma3")
    tokens = tokens_of(run(core)["r"])
    causal = {key: value for key, value in processed.items() if key != "token_type_ids"}
    assert tokens == reference_tokens(tiny("gemma3"), causal, 8)
    assert tokens != reference_tokens(tiny("gemma3"), processed, 8)


def _block_inside_a_run(first: list[int], second: list[int], runs: np.ndarray) -> int:
    """A block size whose cached prefix of `first` shared by `second` ends inside a run."""
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    for size in range(2, 16):
        cached = shared // size * size
        if any(start < cached < stop for start, stop in runs):
            return size
    raise AssertionError("no block size ends the shared prefix inside an image")


def test_a_cached_prefix_that_ends_inside_an_image_run():
    """Two turns with the same image and other text after it share the blocks of the image's
    first tokens: the second computes the rest of the run, which still sees the whole run."""
    image = random_image(4)
    first_parts, second_parts = ["Hello", image, "and"], ["Hello", image, "but"]
    _, first_ids, images = image_prompt(first_parts, "gemma3")
    _, second_ids, _ = image_prompt(second_parts, "gemma3")
    size = _block_inside_a_run(first_ids, second_ids, images.runs())
    core = gemma3_core(block_size=size)
    submit(core, "first", first_parts, "gemma3")
    run(core)
    processed, _ = submit(core, "second", second_parts, "gemma3")
    outputs = run(core)
    cached = outputs["second"][-1].num_cached_tokens
    assert any(start < cached < stop for start, stop in images.runs())
    assert tokens_of(outputs["second"]) == reference_tokens(tiny("gemma3"), processed, 8)


def test_steps_smaller_than_an_image_are_refused_at_start_and_per_request():
    with pytest.raises(ValueError, match=f"at least {TOKENS_PER_IMAGE}"):
        gemma3_core(max_num_batched_tokens=TOKENS_PER_IMAGE - 1)
    # An image longer than the model's own count (a processor set apart from the model).
    core = gemma3_core()
    small = replace(core.scheduler.config, max_num_batched_tokens=TOKENS_PER_IMAGE - 1)
    core.scheduler.config = small
    _, ids, images = image_prompt(TWO_IMAGES, "gemma3")
    with pytest.raises(InvalidRequestError, match="one step"):
        core.add_request("r", ids, GREEDY, images=images)
    assert core.scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param("cpu", marks=needs_cpu_kernels),
        pytest.param("triton", marks=needs_triton),
    ],
)
def test_each_backend_attends_image_runs_beside_its_own_prompt_kernel(backend):
    """A text prompt and an image prompt in the same steps: the backend's kernel attends the
    text, the torch path the image chunks, and both give transformers' tokens."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    core = gemma3_core(attention_backend=backend, device=device)
    tokenizer = core.tokenizer
    text = tokenizer("Paged attention stores keys and values in fixed-size blocks.")["input_ids"]
    core.add_request("text", text, GREEDY)
    processed, _ = submit(core, "image", TWO_IMAGES, "gemma3")
    outputs = run(core)
    model = tiny("gemma3")
    assert tokens_of(outputs["image"]) == reference_tokens(model, processed, 8)
    alone = reference_tokens(model, {"input_ids": torch.tensor([text])}, 8)
    assert tokens_of(outputs["text"]) == alone
