"""Builders shared by the tests: a tiny random-weight Llama, a tiny byte-level tokenizer, and
engine cores around them."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine.core.config import CacheConfig, EngineConfig, ServingInfo
from engine.core.engine_core import EngineCore
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams, StructuredOutputs
from engine.factory import core_from_model
from engine.kernels.cpu import build as cpu_build
from engine.loading.model_loader import wrap_model

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching admits new requests as soon as others finish.",
    "Café, naïve, jalapeño, 東京, and emoji 🚀 are all valid UTF-8 text.",
    "Hello world! Hello there. How are you today?",
]


# Skips say what the machine lacks, asked of the compiler for the build's target (the CPU's own
# under the default `-march=native`): a kernel that fails to build where the target has what it
# needs fails its tests instead of skipping them.
WHY_NO_KERNELS = cpu_build.why_unsupported()


def _lacks(*features: str) -> str:
    """Why the kernels' tests that need these instruction sets cannot run here ("" where they
    can)."""
    if WHY_NO_KERNELS:
        return f"no CPU kernels here: {WHY_NO_KERNELS}"
    missing = [f for f in features if f not in cpu_build.target_features()]
    if not missing:
        return ""
    return f"the kernels' target ({cpu_build.march()}) lacks {', '.join(missing)}"


NO_PANELS = _lacks("AVX2", "FMA", "F16C")
NO_BF16_PANELS = _lacks("AVX512F", "AVX512BW", "AVX512BF16")
needs_cpu_kernels = pytest.mark.skipif(bool(WHY_NO_KERNELS), reason=f"{WHY_NO_KERNELS}")
needs_panels = pytest.mark.skipif(bool(NO_PANELS), reason=NO_PANELS)
needs_bf16_panels = pytest.mark.skipif(bool(NO_BF16_PANELS), reason=NO_BF16_PANELS)


@lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE over a few sentences: multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", bos_token="<bos>")


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer with a minimal chat template."""
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# The shape of the tests' tiny decoders (any family's config takes these fields), with a wide
# init so that logits are well separated and greedy is stable.
TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
)


def tiny_llama(
    vocab_size: int = 320,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_positions: int = 512,
    **overrides: object,
) -> LlamaForCausalLM:
    """Random weights with a wide init, so logits are well separated and greedy is stable."""
    config = LlamaConfig(
        **TINY_SHAPE
        | dict(
            vocab_size=vocab_size,
            num_hidden_layers=num_layers,
            max_position_embeddings=max_positions,
        ),
        eos_token_id=0,
        bos_token_id=1,
        pad_token_id=0,
        **overrides,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()


def tiny_qwen2(**shape: int) -> Qwen2ForCausalLM:
    """A Qwen2 of `TINY_SHAPE` (or `shape` over it) with q/k/v biases that matter."""
    config = Qwen2Config(
        **TINY_SHAPE | shape, tie_word_embeddings=False, eos_token_id=0, bos_token_id=1
    )
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config).eval()
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.data.normal_(0, 0.2)
    return model


def bf16_reference(half_weights: str) -> torch.nn.Module:
    """The oracle for a bf16 model run `half_weights`' way: transformers in fp32 over the
    bf16-rounded weights, with each linear layer's input rounded to bf16 for bf16 panels."""
    model = tiny_llama(dtype=torch.bfloat16).float()
    if half_weights == "bf16":
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
    return model


def tiny_core(
    model: LlamaForCausalLM | None = None,
    *,
    num_blocks: int = 256,
    block_size: int | None = 4,
    mamba_block_size: int | None = None,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 64,
    enable_chunked_prefill: bool = True,
    max_model_len: int | None = None,
    device: str = "cpu",
    with_tokenizer: bool = True,
    tokenizer: PreTrainedTokenizerFast | None = None,
    kv_cache_dtype: str = "auto",
    kv_cache_memory: int | None = None,
    calculate_kv_scales: bool = False,
    model_path: str = "",
    processor: object = None,
    **config_overrides: object,
) -> tuple[EngineCore, ServingInfo]:
    """An engine core around `model` (a tiny random Llama by default); `model_path` is the
    folder it was saved to, where a test reads something from its files; `processor` an
    image-text model's."""
    model = model if model is not None else tiny_llama()
    torch_device = torch.device(device)
    model = model.to(torch_device)
    if tokenizer is None and with_tokenizer:
        tokenizer = tiny_tokenizer()
    loaded = wrap_model(model, tokenizer, "tiny-llama", model_path, processor)
    config = EngineConfig(
        cache=CacheConfig(
            block_size=block_size,
            mamba_block_size=mamba_block_size,
            num_blocks=num_blocks,
            dtype=kv_cache_dtype,
            kv_cache_memory=kv_cache_memory,
            calculate_kv_scales=calculate_kv_scales,
        ),
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=enable_chunked_prefill,
        max_model_len=max_model_len,
        **config_overrides,
    )
    dtype = next(model.parameters()).dtype
    return core_from_model(loaded, config, torch_device, dtype)


def run_all(
    core: EngineCore, prompts: list[list[int]], params: SamplingParams | list, check: bool = True
) -> dict[str, list[RequestOutput]]:
    """Add every prompt, step until all finish, checking block invariants after each step."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
        core.add_request(f"req-{i}", prompt, p)
    outputs: dict[str, list[RequestOutput]] = {f"req-{i}": [] for i in range(len(prompts))}
    steps = 0
    while core.has_unfinished():
        for output in core.step():
            outputs[output.request_id].append(output)
        if check:
            core.scheduler.check_invariants()
        steps += 1
        assert steps < 10_000, "engine made no progress"
    return outputs


def check_prompt_logprobs(model: Any, chunk: int = 8, length: int = 24) -> None:
    """Finer than greedy tokens: each prompt token's logprob from Conveyor (the prompt in chunks
    of `chunk` tokens) equals transformers' over the whole prompt."""
    rng = random.Random(3)
    prompt = [rng.randrange(2, 320) for _ in range(length)]
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
    core, _ = tiny_core(model, max_num_batched_tokens=chunk)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    entries = [e for o in run_all(core, [prompt], params)["req-0"] for e in o.prompt_logprobs or []]
    got = torch.tensor([e.logprob for e in entries[1:]])
    index = torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])
    torch.testing.assert_close(got, expected[index], atol=1e-4, rtol=1e-4)


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def text_of(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


def reference_greedy(
    model: LlamaForCausalLM,
    prompt: list[int],
    max_new_tokens: int,
    attention: str = "sdpa",
    **generate: object,
) -> list[int]:
    """transformers' own greedy generation, the oracle (EOS ignored so lengths are fixed), with
    its `attention` implementation (`eager` computes soft caps and sinks); `generate` holds
    more of `model.generate`'s arguments (`bad_words_ids`)."""
    with transformers_attention(model, attention):
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            **generate,
        )
    return out[0, len(prompt) :].tolist()


@contextmanager
def transformers_attention(model: Any, attention: str = "sdpa") -> Iterator[None]:
    """`model` runs on transformers' own `attention` meanwhile, whether or not an engine was
    built around it (which sets Conveyor's paged attention); Conveyor's after."""
    model.set_attn_implementation(attention)
    try:
        yield
    finally:
        from engine.attention.hf import register

        model.set_attn_implementation(register())


def sabotage_steps(
    core: EngineCore,
    monkeypatch,
    fail_on: set[int] | None = None,
    message: str = "boom",
    delay: float = 0.0,
) -> None:
    """Wrap the runner: model calls numbered in `fail_on` (1-based; None means all) raise
    RuntimeError(message); every call first sleeps `delay` seconds."""
    import time

    launch = core.runner.launch
    calls = 0

    def sabotaged(output):
        nonlocal calls
        calls += 1
        time.sleep(delay)
        if fail_on is None or calls in fail_on:
            raise RuntimeError(message)
        return launch(output)

    monkeypatch.setattr(core.runner, "launch", sabotaged)


def round_to_int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x with each block of 32 features rounded to int8 steps of max|x| / 127, as the int8
    panels round a linear layer's input (`csrc/linear/int8_panels.cpp`), in fp32."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros(()))
    return ((blocks * inverse).round() * (top / 127)).reshape(x.shape)


def int8_layer_errors(layers: list[torch.nn.Module]) -> list[float]:
    """Watch layers over int8 panels: each call appends how far its output is from fp64 over its
    weight and its input rounded to 8-bit blocks, plus the residual it was given (relative,
    floored at 1e-3 of the largest)."""
    errors: list[float] = []

    def check(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        x = args[0].reshape(-1, module.in_features)
        bias = None if module.bias is None else module.bias.double()
        expected = torch.nn.functional.linear(
            round_to_int8_blocks(x).double(), module.weight.double(), bias
        )
        if len(args) > 1 and args[1] is not None:
            expected = expected + args[1].reshape(expected.shape).double()
        gap = (out.reshape(expected.shape).double() - expected).abs()
        errors.append((gap / (expected.abs() + 1e-3 * expected.abs().max())).max().item())

    for layer in layers:
        layer.register_forward_hook(check)
    return errors


def teacher_forced_argmax(model: LlamaForCausalLM, ids: list[int]) -> list[int]:
    """transformers' top token after each position of `ids`."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            logits = model(torch.tensor([ids], device=model.device)).logits[0]
    finally:
        from engine.attention.hf import register

        model.set_attn_implementation(register())
    return logits.argmax(-1).tolist()


def grammar_compiler(tokenizer: Any = None) -> Any:
    """A grammar compiler for `tokenizer` (the tiny one by default) over its whole vocabulary."""
    from engine.structured.compiler import GrammarCompiler

    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
    return GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))


def format_allows(compiler: Any, spec: StructuredOutputs, text: str) -> bool:
    """Whether `text`, ended there, is an output the format `spec` allows (its tokens fed to
    a fresh matcher)."""
    matcher = compiler.matcher(spec)
    ids = compiler._hf_tokenizer.encode(text, add_special_tokens=False)
    return bool(matcher.consume_tokens(ids) and matcher.is_accepting())


def reference_nucleus(row: torch.Tensor, top_p: float) -> set[int]:
    """Every token whose probability mass strictly above it is below top_p (the best token
    always), summed in double over the whole sorted row."""
    values, order = row.double().sort()
    probs = torch.softmax(values, dim=0)
    above = torch.cat([probs.flip(0).cumsum(0).flip(0)[1:], torch.zeros(1, dtype=probs.dtype)])
    # A token's mass strictly above counts from the end of its run of ties.
    last_of_ties = torch.searchsorted(values, values, right=True) - 1
    keep = above[last_of_ties] < top_p
    keep[-1] = True
    return set(order[keep].tolist())


def reference_kept(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The tokens a row keeps: every one at least its k-th largest logit (0: no top-k), then
    the nucleus of those, renormalised (`reference_nucleus`)."""
    if 0 < top_k < row.shape[0]:
        kth = row.sort(descending=True).values[top_k - 1]
        row = row.masked_fill(row < kth, float("-inf"))
    finite = set(torch.isfinite(row).nonzero().flatten().tolist())
    return reference_nucleus(row, top_p) & finite if finite else set()


def reference_draw(
    row: torch.Tensor, top_k: int, top_p: float, min_p: float, uniform: float
) -> int:
    """The token a uniform draws from a row of scaled logits, in double: the running sum, in
    token order, of its kept tokens' probabilities (`reference_kept`; those below min_p times
    the best dropped), the first token whose sum passes `uniform` of their total."""
    probs = torch.softmax(row.double(), dim=0)
    kept = torch.zeros_like(probs)
    tokens = sorted(reference_kept(row, top_k, top_p))
    kept[tokens] = probs[tokens]
    kept[kept < min_p * kept.max()] = 0.0
    running = kept.cumsum(0)
    return int(torch.searchsorted(running, uniform * running[-1], right=True))
