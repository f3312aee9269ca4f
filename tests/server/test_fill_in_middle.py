"""`suffix` on completions: the prompt is framed with the model's fill-in-the-middle tokens
(after the tokenizer's leading BOS), the engine's greedy middle is transformers' on that frame,
every family's tokens are found, and what `suffix` cannot go with is refused."""

from __future__ import annotations

import copy

import pytest
from tokenizers import processors

from server.fill_in_middle import FAMILIES, fill_in_middle_prompts, fim_tokens
from tests.helpers import reference_greedy, tiny_llama, tiny_tokenizer
from tests.server_utils import app_client

QWEN = FAMILIES[0]


def fim_tokenizer(names: tuple[str, ...] = QWEN, bos: bool = False):
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": list(names)})
    if bos:
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", tokenizer.bos_token_id)]
        )
    return tokenizer


@pytest.mark.parametrize("names", FAMILIES, ids=["qwen", "starcoder", "deepseek"])
def test_each_familys_tokens_are_found(names) -> None:
    tokenizer = fim_tokenizer(names)
    found = fim_tokens(tokenizer)
    assert found is not None
    assert (found.prefix, found.suffix, found.middle) == tuple(
        tokenizer.convert_tokens_to_ids(list(names))
    )
    assert fim_tokens(tiny_tokenizer()) is None


def test_the_frame_comes_after_the_leading_bos() -> None:
    tokenizer = fim_tokenizer(bos=True)
    pre, suf, mid = tokenizer.convert_tokens_to_ids(list(QWEN))
    bos = tokenizer.bos_token_id
    before = tokenizer.encode("def add(a, b):", add_special_tokens=False)
    after = tokenizer.encode("\n    return c", add_special_tokens=False)
    [framed, from_ids, bare] = [
        *fill_in_middle_prompts(
            tokenizer, ["def add(a, b):", [bos, *before]], "\n    return c", True
        ),
        *fill_in_middle_prompts(tokenizer, ["def add(a, b):"], "\n    return c", False),
    ]
    assert framed == from_ids == [bos, pre, *before, suf, *after, mid]
    assert bare == [pre, *before, suf, *after, mid]


async def test_the_middle_is_transformers_greedy_continuation_of_the_frame() -> None:
    tokenizer = fim_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer))
    body = {
        "model": "tiny",
        "prompt": "def add(a, b):\n    c = ",
        "suffix": "\n    return c\n",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with app_client(model=model, tokenizer=tokenizer) as (client, _):
        rendered = await client.post("/v1/completions/render", json=body)
        [frame] = [entry["token_ids"] for entry in rendered.json()]
        assert frame[-1] == tokenizer.convert_tokens_to_ids(QWEN[2])
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        [choice] = response.json()["choices"]
        assert choice["prompt_token_ids"] == frame
        assert choice["token_ids"] == reference_greedy(model, frame, 8)


@pytest.mark.parametrize(
    ("fields", "param", "tokenizer"),
    [
        ({"suffix": "tail"}, "suffix", tiny_tokenizer),  # no fill-in-the-middle tokens
        ({"suffix": "tail", "echo": True}, "echo", fim_tokenizer),
        ({"suffix": "tail", "truncate_prompt_tokens": 5}, "truncate_prompt_tokens", fim_tokenizer),
    ],
)
async def test_what_suffix_cannot_go_with_is_refused(fields, param, tokenizer) -> None:
    tokenizer = tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer))
    async with app_client(model=model, tokenizer=tokenizer) as (client, _):
        body = {"model": "tiny", "prompt": "x = ", "max_tokens": 2, **fields}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
