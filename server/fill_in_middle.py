"""`suffix` on completions (OpenAI's field): fill in the middle. The prompt is the text before the
gap and `suffix` the text after it; the model writes what goes between, prompted in the frame
its code training used, with the fill-in-the-middle tokens its tokenizer holds:

- `<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>`: Qwen2.5-Coder, Qwen3-Coder, CodeGemma;
- `<fim_prefix>`, `<fim_suffix>`, `<fim_middle>`: StarCoder, StarCoder2, Granite Code;
- `<｜fim▁begin｜>`, `<｜fim▁hole｜>`, `<｜fim▁end｜>`: DeepSeek-Coder;

each as prefix-suffix-middle: `PRE prompt SUF suffix MID`, after the tokenizer's own leading
tokens (a BOS). A model whose tokenizer holds none of these is refused with a 400."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.errors import InvalidRequestError
from server.tokenization import encode_text

# The fill-in-the-middle tokens of each family: before the prefix, before the suffix, before
# the middle the model writes.
FAMILIES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


@dataclass(frozen=True, slots=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int


def fim_tokens(tokenizer: Any) -> FimTokens | None:
    """The fill-in-the-middle tokens `tokenizer` holds, or None."""
    vocabulary = tokenizer.get_vocab()
    for names in FAMILIES:
        if all(name in vocabulary for name in names):
            return FimTokens(*(vocabulary[name] for name in names))
    return None


def fill_in_middle_prompts(
    tokenizer: Any,
    prompts: list[str | list[int]],
    suffix: str,
    add_special_tokens: bool,
) -> list[list[int]]:
    """Each prompt framed with `suffix` as its model's fill-in-the-middle prompt: a text prompt
    after the tokenizer's leading tokens (where `add_special_tokens`), token ids as given."""
    tokens = fim_tokens(tokenizer) if tokenizer is not None else None
    if tokens is None:
        raise InvalidRequestError(
            "suffix needs a model trained to fill in the middle; this model's tokenizer has no "
            "fill-in-the-middle tokens.",
            param="suffix",
        )
    lead = encode_text(tokenizer, "", add_special_tokens)
    after = encode_text(tokenizer, suffix, False)
    framed = []
    for prompt in prompts:
        if isinstance(prompt, str):
            before = [*lead, *encode_text(tokenizer, prompt, False)]
        else:
            before = list(prompt)
        head, body = _split_lead(before, lead)
        framed.append([*head, tokens.prefix, *body, tokens.suffix, *after, tokens.middle])
    return framed


def _split_lead(ids: list[int], lead: list[int]) -> tuple[list[int], list[int]]:
    """The tokenizer's leading tokens, where `ids` starts with them, and the rest."""
    if lead and ids[: len(lead)] == lead:
        return ids[: len(lead)], ids[len(lead) :]
    return [], ids


def check_suffix(echo: bool, truncating: bool) -> None:
    """What `suffix` cannot go with."""
    if echo:
        raise InvalidRequestError("echo cannot be combined with suffix.", param="echo")
    if truncating:
        raise InvalidRequestError(
            "truncate_prompt_tokens cannot cut a fill-in-the-middle prompt.",
            param="truncate_prompt_tokens",
        )
