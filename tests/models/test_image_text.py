"""Image-text models in the engine: greedy tokens equal transformers' `generate` over the same
processed prompt, with images cut by chunked prefill, beside text requests, after preemption
and from the prefix cache; the encoder runs once per request and never for a cached image."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, Mistral3Config, MllamaConfig

from engine.core.config import EngineConfig
from engine.core.errors import InvalidRequestError, RequestFailedError
from engine.core.images import TEXT_KEYS, ImageInputs, image_starts
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.loading.model_loader import auto_model_class, load_model
from engine.models import build_causal_lm
from engine.models.vision import (
    IMAGE_TEXT_TYPES,
    PagedGemmaImageTextLM,
    PagedImageTextLM,
    PagedQwen3_5ImageTextLM,
    TransformersImageTextLM,
    takes_images,
)
from tests.conftest import CUDA
from tests.helpers import tiny_core, tokens_of
from tests.vision_utils import (
    FAMILIES,
    TOKENS_PER_IMAGE,
    image_prompt,
    processor_of,
    random_image,
    reference_tokens,
    save_tiny,
    tiny_image_text,
    tiny_llava,
)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def image_text_core(family: str = "llava", **options):
    processor = processor_of(family)
    model = tiny_image_text(family)
    return tiny_core(model, tokenizer=processor.tokenizer, processor=processor, **options)[0]


def count_encodings(core, monkeypatch) -> list[int]:
    """Record the number of feature rows of each encoder run."""
    model = core.runner.model
    assert takes_images(model)
    encode, runs = model.image_encoder, []

    def counted(data):
        features = encode(data)
        runs.append(features.shape[0])
        return features

    monkeypatch.setattr(model, "image_encoder", counted)
    return runs


def submit(core, request_id: str, parts: list, family: str = "llava"):
    """Queue a user turn of `parts`; return the processor's output and the prompt's number of
    image placeholders."""
    processed, ids, images = image_prompt(parts, family)
    core.add_request(request_id, ids, GREEDY, images=images)
    return processed, len(images.positions)


def run(core) -> dict[str, list]:
    """Step until every request ends, checking the blocks' invariants after each step."""
    outputs: dict[str, list] = {}
    while core.has_unfinished():
        for output in core.step():
            outputs.setdefault(output.request_id, []).append(output)
        core.scheduler.check_invariants()
    return outputs


# Qwen3-VL's tower feeds decoder layers, which only Conveyor's decoder takes from outside;
# Qwen3.5's linear attention keeps states only Conveyor's decoder holds.
DECODER_ONLY = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
IMPLS = [
    (impl, family)
    for impl in ("conveyor", "transformers")
    for family in FAMILIES
    if impl == "conveyor" or family not in DECODER_ONLY
]
# Conveyor's decoder for each family's language model.
PAGED = {
    "gemma3": PagedGemmaImageTextLM,
    "qwen3_5": PagedQwen3_5ImageTextLM,
    "qwen3_5_moe": PagedQwen3_5ImageTextLM,
}


@pytest.mark.parametrize(("impl", "family"), IMPLS)
@pytest.mark.parametrize("budget", [512, 10, 3])
def test_greedy_tokens_equal_generate_with_images_cut_by_chunks(monkeypatch, impl, family, budget):
    """Conveyor's decoder for the language model, or transformers' model whole: the same tokens
    as transformers' `generate`."""
    if family == "gemma3":  # its images are computed whole: a step holds one and a token
        budget = max(budget, TOKENS_PER_IMAGE + 1)
    core = image_text_core(family, model_impl=impl, max_num_batched_tokens=budget)
    paged = PAGED.get(family, PagedImageTextLM)
    assert type(core.runner.model) is (paged if impl == "conveyor" else TransformersImageTextLM)
    encodings = count_encodings(core, monkeypatch)
    one, rows_one = submit(core, "one", [random_image(1), "The quick brown fox"], family)
    wide = random_image(3, width=60)  # tiled 2x1 (plus the whole) by Idefics3
    two, rows_two = submit(core, "two", ["Hello", random_image(2), "and", wide], family)
    outputs = run(core)
    reference = tiny_image_text(family)
    assert tokens_of(outputs["one"]) == reference_tokens(reference, one, 8)
    assert tokens_of(outputs["two"]) == reference_tokens(reference, two, 8)
    # Each request's encoder ran once, over all of its images, however its prompt was cut.
    assert sorted(encodings) == sorted([rows_one, rows_two])


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_generate_on_a_gpu(device, family):
    """The encoder's inputs and rows, and the step's indices, go where the model runs."""
    core = image_text_core(family, device=device, max_num_batched_tokens=10)
    one, _ = submit(core, "one", [random_image(1), "The quick brown fox"], family)
    two, _ = submit(core, "two", ["Hello", random_image(2), "and", random_image(3)], family)
    outputs = run(core)
    reference = tiny_image_text(family)
    assert tokens_of(outputs["one"]) == reference_tokens(reference, one, 8)
    assert tokens_of(outputs["two"]) == reference_tokens(reference, two, 8)


def test_the_images_change_the_tokens():
    """The oracle sees the pixels: the same text with another image gives other tokens."""
    core = image_text_core()
    submit(core, "a", [random_image(1), "The quick brown fox"])
    submit(core, "b", [random_image(4), "The quick brown fox"])
    outputs = run(core)
    assert tokens_of(outputs["a"]) != tokens_of(outputs["b"])


def test_text_requests_run_beside_image_requests_unchanged():
    processor = processor_of("llava")
    core = image_text_core(max_num_batched_tokens=16)
    text = processor.tokenizer("Hello world! Hello there.")["input_ids"]
    core.add_request("text", text, GREEDY)
    image, _ = submit(core, "image", ["Paged attention", random_image(5)])
    outputs = run(core)
    alone = image_text_core()
    alone.add_request("text", text, GREEDY)
    assert tokens_of(outputs["text"]) == tokens_of(run(alone)["text"])
    assert tokens_of(outputs["image"]) == reference_tokens(tiny_llava(), image, 8)


def test_a_cached_image_skips_the_encoder_and_another_image_misses(monkeypatch):
    core = image_text_core(block_size=4)
    encodings = count_encodings(core, monkeypatch)
    parts = [random_image(6), "Continuous batching admits new requests"]
    first, _ = submit(core, "first", parts)
    run(core)
    again, _ = submit(core, "again", parts)
    submit(core, "other", [random_image(7), *parts[1:]])
    outputs = run(core)
    reference = tiny_llava()
    assert tokens_of(outputs["again"]) == reference_tokens(reference, again, 8)
    assert tokens_of(outputs["again"]) == reference_tokens(reference, first, 8)
    cached = {rid: outputs[rid][-1].num_cached_tokens for rid in ("again", "other")}
    # The repeat found every full block cached, images included: its encoder never ran.
    assert cached["again"] >= 8 + TOKENS_PER_IMAGE
    # The other image shares the text before it only (the turn's opening tokens).
    assert cached["other"] < 8 + TOKENS_PER_IMAGE
    assert encodings == [TOKENS_PER_IMAGE, TOKENS_PER_IMAGE]


@pytest.mark.parametrize("family", FAMILIES)
def test_preempted_image_requests_recompute_the_same_tokens(monkeypatch, family):
    # Room for one request at a time (prompts differ in length: tiles, image markers).
    blocks = {"llava": 14, "gemma3": 16}.get(family, 24)
    core = image_text_core(family, num_blocks=blocks, block_size=4, max_num_batched_tokens=8)
    encodings = count_encodings(core, monkeypatch)
    processed = {
        rid: submit(core, rid, [random_image(10 + i), "Paged attention stores keys"], family)[0]
        for i, rid in enumerate(("a", "b", "c"))
    }
    outputs = run(core)
    reference = tiny_image_text(family)
    assert core.scheduler.num_preemptions > 0
    for rid, inputs in processed.items():
        assert tokens_of(outputs[rid]) == reference_tokens(reference, inputs, 8)
    # Features stay with their request: a recomputed prompt does not run the encoder again.
    assert len(encodings) == 3


def test_features_that_do_not_fit_the_placeholders_fail_that_request_alone():
    core = image_text_core()
    _, ids, images = image_prompt([random_image(8), "The quick"])
    broken = ImageInputs(images.positions[:-1], images.starts, images.data)
    core.add_request("broken", ids, GREEDY, images=broken)
    fine, _ = submit(core, "fine", [random_image(9), "The quick"])
    outputs = run(core)
    last = outputs["broken"][-1]
    assert last.finish_reason == "error" and isinstance(last.error, RequestFailedError)
    assert "feature rows" in str(last.error)
    assert tokens_of(outputs["fine"]) == reference_tokens(tiny_llava(), fine, 8)
    assert core.scheduler.block_manager.num_used_blocks == 0


def test_a_text_model_refuses_images(tiny_model):
    core, _ = tiny_core(tiny_model)
    _, ids, images = image_prompt([random_image(1), "hi"])
    with pytest.raises(InvalidRequestError, match="does not take images"):
        core.add_request("r", [i % 300 for i in ids], GREEDY, images=images)


def test_each_run_of_placeholders_starts_an_image_or_all_count_from_the_first():
    positions = np.array([3, 4, 5, 9, 10, 11])
    assert image_starts(positions, [b"a", b"b"]) == ((3, b"a"), (9, b"b"))
    # Three runs for two images (tiles with text between): one digest of both, at the first.
    tiled = np.array([3, 4, 7, 8, 12])
    ((start, digest),) = image_starts(tiled, [b"a", b"b"])
    assert start == 3 and digest not in (b"a", b"b")
    assert image_starts(tiled, [b"a", b"c"])[0][1] != digest


def test_every_served_family_is_built_here():
    assert sorted(FAMILIES) == sorted(IMAGE_TEXT_TYPES)


def test_unserved_image_text_families_parallel_and_pooling_runs_are_refused_by_name(tmp_path):
    for config in (Mistral3Config(), MllamaConfig()):
        folder = tmp_path / config.model_type
        config.save_pretrained(folder)
        with pytest.raises(ValueError, match=f"images of {config.model_type} models"):
            auto_model_class(str(folder))
    llava = save_tiny(tmp_path / "llava")
    parallel = EngineConfig(model=str(llava), device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="text models only"):
        create_engine_core(parallel)
    with pytest.raises(ValueError, match="text"):
        create_engine_core(EngineConfig(model=str(llava), device="cpu", runner="pooling"))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_16_bit_model_keeps_its_vision_encoder_in_torch_and_its_dtype(tmp_path, family):
    """Under a 16-bit form only the language model widens to fp32 between layers: the encoder
    stays transformers' own bf16 layers, and its rows are exactly transformers' bf16 rows."""
    folder = save_tiny(tmp_path / family, family)
    loaded = load_model(str(folder), torch.bfloat16, torch.device("cpu"))
    model = build_causal_lm(loaded.model)
    assert takes_images(model)
    decoder = {id(p) for p in loaded.model.get_decoder().parameters()}
    encoder = [p for p in loaded.model.model.parameters() if id(p) not in decoder]
    assert encoder and all(p.dtype == torch.bfloat16 for p in encoder)
    processed, _, images = image_prompt([random_image(12), "hi"], family)
    rows = model.image_encoder(images.data)
    reference = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16)
    inputs = {k: v for k, v in processed.items() if k not in TEXT_KEYS}
    inputs["pixel_values"] = inputs["pixel_values"].bfloat16()
    with torch.inference_mode():
        found = reference.model.get_image_features(**inputs)
    # The embeddings' rows, then (Qwen3-VL) those each fed decoder layer adds, side by side.
    hidden = loaded.model.config.get_text_config().hidden_size
    parts = [found.pooler_output, *(getattr(found, "deepstack_features", None) or [])]
    expected = torch.cat([torch.cat([p.reshape(-1, hidden) for p in part]) for part in parts], -1)
    assert rows.dtype == loaded.compute_dtype
    assert torch.equal(rows, expected.to(rows.dtype))


@pytest.mark.parametrize("chunked", [True, False])
def test_each_step_encodes_within_its_encoder_budget_and_at_least_one_request(monkeypatch, chunked):
    """With room for one image's rows a step, three image requests arriving together are
    encoded on three steps (the one with two images, over the budget, on a step of its own);
    the text before a deferred image still runs, where chunks may be cut."""
    core = image_text_core(
        max_num_encoder_input_tokens=TOKENS_PER_IMAGE, enable_chunked_prefill=chunked
    )
    steps: list[int] = []
    step_sizes: list[dict[str, int]] = []
    encode, schedule = core.runner.model.image_encoder, core.scheduler.schedule

    def recorded(data):
        steps.append(len(step_sizes) - 1)
        return encode(data)

    def scheduled():
        output = schedule()
        step_sizes.append({item.request.request_id: item.num_tokens for item in output.scheduled})
        return output

    monkeypatch.setattr(core.runner.model, "image_encoder", recorded)
    monkeypatch.setattr(core.scheduler, "schedule", scheduled)
    two, _ = submit(core, "two", ["A long line of text first", random_image(20), random_image(21)])
    one, _ = submit(core, "one", ["Hello there", random_image(22)])
    other, _ = submit(core, "other", [random_image(23), "Hello"])
    outputs = run(core)
    assert steps == [0, 1, 2]
    reference = tiny_llava()
    for rid, processed in (("two", two), ("one", one), ("other", other)):
        assert tokens_of(outputs[rid]) == reference_tokens(reference, processed, 8)
    # In the first step "one" ran its text up to its image (chunked), or waited whole.
    prompt_one = image_prompt(["Hello there", random_image(22)])[2].positions[0]
    assert step_sizes[0].get("one", 0) == (prompt_one if chunked else 0)
