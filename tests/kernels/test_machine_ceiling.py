"""The accounting behind `benchmarks/machine_ceiling.py`: a model's work per token and a wave's
ceilings, checked against a tiny model's own layers and against the work counted token by token."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_llama

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "machine_ceiling.py"


@pytest.fixture(scope="module")
def ceiling():
    spec = importlib.util.spec_from_file_location("machine_ceiling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=3)


def test_macs_per_token_are_the_weights_of_every_linear_layer(ceiling, model):
    shape = ceiling.ModelShape.from_config(model.config)
    weights = sum(
        module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear)
    )
    assert shape.linear_macs() + shape.head_macs() == weights
    assert shape.weight_bytes() == 2 * weights


def test_kv_bytes_are_what_the_k_and_v_projections_write(ceiling, model):
    shape = ceiling.ModelShape.from_config(model.config)
    attention = model.model.layers[0].self_attn
    per_layer = attention.k_proj.out_features + attention.v_proj.out_features
    assert shape.kv_bytes() == 2 * per_layer * len(model.model.layers)


def test_attention_macs_are_a_query_rows_scores_and_weighted_values(ceiling, model):
    shape = ceiling.ModelShape.from_config(model.config)
    query = model.model.layers[0].self_attn.q_proj.out_features
    assert shape.attention_macs(7) == 2 * 7 * query * len(model.model.layers)


def _macs_token_by_token(shape, concurrency: int, input_len: int, output_len: int) -> int:
    """Every multiply-add of one wave, a token at a time: each prompt token through the layers
    and its attention, the last one through the head, then each decode token likewise."""
    per_request = 0
    for position in range(input_len):
        per_request += shape.linear_macs() + shape.attention_macs(position + 1)
    per_request += shape.head_macs()
    for step in range(1, output_len):
        per_request += (
            shape.linear_macs() + shape.head_macs() + shape.attention_macs(input_len + step)
        )
    return concurrency * per_request


def test_with_memory_free_both_ceilings_are_the_arithmetic(ceiling, model):
    shape = ceiling.ModelShape.from_config(model.config)
    rate = 1e9
    ceilings = ceiling.wave_ceilings(shape, 4, 10, 6, rate, math.inf)
    expected = 4 * 6 / (_macs_token_by_token(shape, 4, 10, 6) / rate)
    assert ceilings["overlapped"] == pytest.approx(expected, abs=0.1)
    assert ceilings["attention_after"] == pytest.approx(expected, abs=0.1)


def test_attention_waiting_on_memory_lowers_the_ceiling(ceiling, model):
    shape = ceiling.ModelShape.from_config(model.config)
    # Products bound by their arithmetic, attention by its K/V reads: only overlapped hides the
    # reads, as if memory were free.
    ceilings = ceiling.wave_ceilings(shape, 64, 128, 128, 1e9, 5e8)
    free = ceiling.wave_ceilings(shape, 64, 128, 128, 1e9, math.inf)
    assert ceilings["attention_after"] < ceilings["overlapped"] == free["overlapped"]
