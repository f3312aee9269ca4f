"""Serving LoRA adapters: greedy tokens under an adapter equal PEFT's merged model's, whatever
else shares the step; the rows of the base model are untouched by the adapters beside them;
at most `max_loras` adapters run in a step; cached prefixes never cross adapters; a removed
adapter serves the requests that named it before its weights go."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.core.speculation import SpeculativeConfig
from engine.kernels.cpu.linear import GatedPanelLinear
from engine.lora.registry import LoRARequest
from tests.core.test_speculation import ScriptedDrafter
from tests.helpers import reference_greedy, tiny_core, tiny_llama, tokens_of
from tests.kernels.test_decode_layer import BF16, packed
from tests.lora.adapters import ATTENTION, MLP, merged, save_adapter
from tests.models.test_model_families import build

PROMPTS = [[5, 9, 33, 2, 17], list(range(40, 70)), [7] * 13]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    """One adapter of the attention's projections (rank 4), one of the MLP's and q (rank 8)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": save_adapter(root / "attn", ATTENTION, seed=1, rank=4),
        "mlp": save_adapter(root / "mlp", [*MLP, "q_proj"], seed=2, rank=8),
    }


def lora_core(adapters: dict[str, str], max_loras: int = 2, model=None, **options):
    model = model if model is not None else tiny_llama()
    return tiny_core(
        model,
        enable_lora=True,
        max_loras=max_loras,
        lora_modules=tuple(adapters.items()),
        **options,
    )[0]


def run(core, requests: list[tuple[list[int], str | None]], params=GREEDY) -> list[list[int]]:
    """Each (prompt, adapter name or None) as one request, all queued at once; their tokens."""
    for i, (prompt, name) in enumerate(requests):
        lora = core.loras.get(name) if name is not None else None
        core.add_request(f"r{i}", prompt, params, lora=lora)
    outputs: dict[str, list] = {f"r{i}": [] for i in range(len(requests))}
    while core.has_unfinished():
        for output in core.step():
            outputs[output.request_id].append(output)
        core.scheduler.check_invariants()
    return [tokens_of(outputs[f"r{i}"]) for i in range(len(requests))]


def oracle(adapters: dict[str, str], prompt: list[int], name: str | None) -> list[int]:
    model = tiny_llama() if name is None else merged(adapters[name])
    return reference_greedy(model, prompt, GREEDY.max_tokens)


def mixed(names: list[str | None]) -> list[tuple[list[int], str | None]]:
    """Every prompt under every name: base-model and adapter rows in the same steps."""
    return [(prompt, name) for name in names for prompt in PROMPTS]


def test_greedy_tokens_under_each_adapter_equal_peft_merged_models(adapters, device):
    requests = mixed([None, "attn", "mlp"])
    got = run(lora_core(adapters, device=device), requests)
    for (prompt, name), tokens in zip(requests, got, strict=True):
        assert tokens == oracle(adapters, prompt, name), (prompt, name)
    base = got[: len(PROMPTS)]
    assert all(adapted != base for adapted in (got[3:6], got[6:9]))  # the adapters act


def test_one_slot_runs_one_adapter_a_step_and_every_request_still_gets_its_own(adapters):
    core = lora_core(adapters, max_loras=1)
    slots = core.runner.lora
    seen: list[set[int]] = []
    begin = slots.begin

    def counting(loras: list[LoRARequest | None], query_lens: np.ndarray) -> bool:
        seen.append({lora.lora_id for lora in loras if lora is not None})
        return begin(loras, query_lens)

    slots.begin = counting
    requests = [(PROMPTS[0], "attn"), (PROMPTS[1], "mlp"), (PROMPTS[2], "attn"), (PROMPTS[0], None)]
    got = run(core, requests)
    for (prompt, name), tokens in zip(requests, got, strict=True):
        assert tokens == oracle(adapters, prompt, name), (prompt, name)
    assert max(len(ids) for ids in seen) == 1
    assert len({frozenset(ids) for ids in seen if ids}) == 2  # both ran, in turn


@pytest.mark.parametrize("weights", ["fp32", BF16])
def test_base_rows_beside_adapter_rows_are_the_base_models_own(tmp_path, adapters, weights):
    """An adapter whose B is zero (as PEFT starts one) changes nothing, so every row of a step
    that runs adapters takes the adapted path (layer by layer where decode steps otherwise
    run the fused stack; gate and up apart where bf16 panels otherwise compute them gated) and
    must still give the tokens the base model gives alone, over the panels served here."""
    zero = save_adapter(tmp_path / "zero", [*ATTENTION, *MLP], seed=3, zero=True)
    alone = run(tiny_core(packed(tiny_llama(), weights))[0], mixed([None]))
    core = lora_core({**adapters, "zero": zero}, model=packed(tiny_llama(), weights))
    layer = core.runner.model.layers[0]
    assert (weights == "bf16") == isinstance(layer.gate_up_proj, GatedPanelLinear)
    got = run(core, mixed([None, "zero", "mlp"]))
    assert got[:3] == alone and got[3:6] == alone
    assert got[6:] != alone


def test_async_steps_give_the_tokens_of_steps_in_turn(adapters):
    requests = mixed([None, "attn", "mlp"])
    in_turn = run(lora_core(adapters, async_scheduling=False), requests)
    assert run(lora_core(adapters, async_scheduling=True), requests) == in_turn


def test_cached_blocks_are_reused_under_the_same_adapter_only(adapters):
    core = lora_core(adapters)
    prompt = list(range(100, 140))

    def cached(request_id: str, name: str | None) -> int:
        lora = core.loras.get(name) if name is not None else None
        request = core.add_request(request_id, prompt, GREEDY, lora=lora)
        while core.has_unfinished():
            core.step()
        assert request.output_token_ids == oracle(adapters, prompt, name)
        return request.num_cached_tokens

    assert cached("base", None) == 0
    assert cached("attn", "attn") == 0  # the base model's blocks are not its own
    assert cached("attn-again", "attn") > 0
    assert cached("mlp", "mlp") == 0
    assert cached("base-again", None) > 0


def test_a_removed_adapter_finishes_its_requests_then_frees_its_weights(adapters):
    core = lora_core(adapters)
    lora = core.loras.get("attn")
    request = core.add_request("r", PROMPTS[1], GREEDY, lora=lora)
    core.step()
    core.loras.remove("attn")
    core.retire_lora(lora)
    assert core.runner.has_lora(lora.lora_id)
    while core.has_unfinished():
        core.step()
        core.drop_retired()
    assert request.output_token_ids == oracle(adapters, PROMPTS[1], "attn")
    assert not core.runner.has_lora(lora.lora_id)
    with pytest.raises(Exception, match="not loaded"):
        core.add_request("late", PROMPTS[0], GREEDY, lora=lora)


def test_the_step_stats_name_the_adapters_running_and_waiting(adapters):
    core = lora_core(adapters, max_loras=1, max_num_seqs=2)
    for i, name in enumerate(["attn", "attn", "mlp"]):
        core.add_request(f"r{i}", PROMPTS[i], GREEDY, lora=core.loras.get(name))
    core.step()
    stats = core.take_stats()
    assert stats.running_loras == ("attn",) and stats.waiting_loras == ("mlp",)


def test_adapter_steps_bypass_what_runs_the_base_model_alone(adapters, monkeypatch):
    """Compiled pieces and graphs hold the base model's products: a step with adapter rows
    must not call them (they stand in here as the layers' instance attributes, as
    `--compile` installs them), while a step of the base model alone still does."""
    core = lora_core(adapters)
    calls: list[str] = []
    for layer in core.runner.model.layers:
        for piece in ("project_qkv", "after_attention"):
            original = getattr(layer, piece)

            def counted(*args, _original=original, _piece=piece):
                calls.append(_piece)
                return _original(*args)

            monkeypatch.setattr(layer, piece, counted, raising=False)
    [adapted] = run(core, [(PROMPTS[0], "attn")])
    assert calls == [] and adapted == oracle(adapters, PROMPTS[0], "attn")
    run(core, [(PROMPTS[1], None)])
    assert calls  # the prompt's step of the base model took the installed pieces


@pytest.mark.parametrize("family", ["granite", "olmo2", "arcee"])
def test_adapters_of_families_with_their_own_layers_equal_peft_merged(tmp_path, family):
    """Granite's scaled residual adds, OLMo 2's moved norms and Arcee's MLP without a gate (its
    up adapted alone) take the adapters' deltas where PEFT's merged weights put them."""
    path = save_adapter(tmp_path / family, [*ATTENTION, *MLP], seed=5, base=lambda: build(family))
    core = lora_core({"a": path}, model=build(family))
    got = run(core, [(PROMPTS[1], None), (PROMPTS[1], "a")])
    assert got[0] == reference_greedy(build(family), PROMPTS[1], GREEDY.max_tokens)
    assert got[1] == reference_greedy(merged(path, build(family)), PROMPTS[1], GREEDY.max_tokens)
    assert got[0] != got[1]


def test_drafts_are_verified_under_each_request_s_adapter(adapters):
    """Speculation: a request's draft rows run under its own adapter, beside base rows."""
    requests = mixed([None, "attn", "mlp"])
    truths = {f"r{i}": oracle(adapters, prompt, name) for i, (prompt, name) in enumerate(requests)}
    spec = SpeculativeConfig(3, 1, 1, disable_by_batch_size=64)
    core = lora_core(adapters, speculative=spec)
    core.drafter = ScriptedDrafter(truths, 3, 3, limit=64)
    got = run(core, requests)
    assert got == [truths[f"r{i}"] for i in range(len(requests))]
    drafts = core.take_stats().drafts
    assert 0 < drafts.num_accepted_tokens < drafts.num_draft_tokens


def recurrent_model(kind: str) -> torch.nn.Module:
    """A tiny model with recurrent layers: Qwen3.5's, Qwen3-Next's (experts), Bamba's (Mamba2),
    Jamba's (Mamba1), LFM2's (short convolutions), Falcon-H1's (attention beside Mamba2, its
    multipliers around the projections), Nemotron-H's (blocks of Mamba2, attention, or an MLP
    without a gate)."""
    from tests.models import (
        test_bamba,
        test_falcon_h1,
        test_jamba,
        test_lfm2,
        test_nemotron_h,
        test_qwen3_5,
    )

    builds = {
        "qwen3.5": lambda: test_qwen3_5.build("dense"),
        "qwen3-next": lambda: test_qwen3_5.build("next"),
        "bamba": test_bamba.build,
        "jamba": lambda: test_jamba.build("dense"),
        "lfm2": test_lfm2.build,
        "falcon-h1": lambda: test_falcon_h1.build("norm-then-gate"),
        "nemotron-h": lambda: test_nemotron_h.build("dense"),
    }
    return builds[kind]()


@pytest.mark.parametrize(
    ("kind", "targets"),
    [
        ("qwen3.5", [*ATTENTION, *MLP]),
        ("qwen3-next", ATTENTION),
        ("bamba", [*ATTENTION, *MLP]),
        ("jamba", [*ATTENTION, *MLP]),
        # LFM2's names for o, gate, up and down (its convolutions' `out_proj` left alone).
        ("lfm2", r".*\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|feed_forward\.w[123])"),
        ("falcon-h1", [*ATTENTION, *MLP]),
        ("nemotron-h", [*ATTENTION, "up_proj", "down_proj"]),  # its MLPs' up alone: no gate
    ],
    ids=["qwen3.5", "qwen3-next", "bamba", "jamba", "lfm2", "falcon-h1", "nemotron-h"],
)
def test_adapters_of_a_model_with_recurrent_layers_equal_peft_merged(tmp_path, kind, targets):
    """The attention layers' projections (Qwen3.5's q rows each head's query and gate) and the
    MLPs of every layer, recurrent ones too, take the adapters' deltas, numbered by the layers'
    places in the decoder (not in the KV cache or among the states); experts take none."""

    def build() -> torch.nn.Module:
        return recurrent_model(kind)

    path = save_adapter(tmp_path / kind, targets, seed=5, base=build)
    core = lora_core({"a": path}, model=build())
    got = run(core, mixed([None, "a"]))
    adapted = merged(path, build())
    base = [reference_greedy(build(), p, GREEDY.max_tokens) for p in PROMPTS]
    assert got == base + [reference_greedy(adapted, p, GREEDY.max_tokens) for p in PROMPTS]
    assert got[: len(PROMPTS)] != got[len(PROMPTS) :]


def test_an_adapter_of_a_deltanets_projections_is_refused_by_name(tmp_path):
    from tests.models import test_qwen3_5

    path = save_adapter(tmp_path / "a", ["in_proj_qkv"], seed=6, base=test_qwen3_5.build)
    with pytest.raises(ValueError, match="in_proj_qkv"):
        lora_core({"a": path}, model=test_qwen3_5.build())


def test_an_adapter_of_a_mamba_blocks_projections_is_refused_by_name(tmp_path):
    """Nemotron-H's Mamba2 blocks take none (PEFT itself refuses their `out_proj`)."""
    from tests.models import test_nemotron_h

    def build() -> torch.nn.Module:
        return test_nemotron_h.build("dense")

    path = save_adapter(tmp_path / "a", ["in_proj"], seed=6, base=build)
    with pytest.raises(ValueError, match="in_proj"):
        lora_core({"a": path}, model=build())


def test_lora_over_recurrent_layers_that_take_none_is_refused():
    """Mamba's own models are their mixers alone: nothing there takes adapters."""
    from tests.models import test_mamba

    with pytest.raises(ValueError, match="LoRA adapters do not adapt yet"):
        tiny_core(test_mamba.build(), enable_lora=True)
