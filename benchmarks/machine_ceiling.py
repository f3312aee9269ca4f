"""The most output tokens a second this machine could give a bf16 model's requests, from two
rates measured here: the bf16 panel products' own rate with their operands in cache, and the rate
a plain sum reads memory. The model's shape gives the work: multiply-adds of its linear layers,
its LM head and its attention, and the bytes a decode step reads (the weights once, every
sequence's K/V).

    python benchmarks/machine_ceiling.py --concurrency 1 16 64

Each concurrency is one wave of requests with random prompts of `--input-len` tokens and
`--output-len` output tokens, EOS ignored, as the side-by-side runs load a server: the prompts
at the products' rate, then every decode step twice over. `overlapped` takes a step as the
longer of its arithmetic and its reads, as if each waited on nothing but the busier of the two;
`attention_after` lets the products' weights stream under their arithmetic but puts the K/V
reads of attention after it, as a step whose attention waits on memory. Neither counts the
norms, rotary, the scheduler, HTTP or the load generator, so a real server stays below both.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch
from transformers import AutoConfig, PretrainedConfig

from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import pack_panels
from engine.loading.default_model import ensure_default_model

BF16_BYTES = 2


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, model: str) -> ModelShape:
        return cls.from_config(AutoConfig.from_pretrained(model))

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelShape:
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", heads),
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size,
        )

    @property
    def qkv_features(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def layer_macs(self) -> int:
        """A token's multiply-adds in one layer's q/k/v, output and gated MLP products."""
        return (
            self.hidden * self.qkv_features
            + self.heads * self.head_dim * self.hidden
            + 3 * self.hidden * self.intermediate
        )

    def linear_macs(self) -> int:
        return self.layers * self.layer_macs()

    def head_macs(self) -> int:
        return self.hidden * self.vocab

    def attention_macs(self, keys: int) -> int:
        """One query token's scores and weighted values over `keys` keys, every layer."""
        return self.layers * 2 * self.heads * self.head_dim * keys

    def kv_bytes(self) -> int:
        """One token's K and V over every layer, in bf16."""
        return self.layers * 2 * self.kv_heads * self.head_dim * BF16_BYTES

    def weight_bytes(self) -> int:
        """One bf16 weight for each of a token's multiply-adds in the products and the head."""
        return (self.linear_macs() + self.head_macs()) * BF16_BYTES


def best_seconds(call, repeats: int) -> float:
    """The shortest of `repeats` calls after a first: a bound takes the machine at its best."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def product_rate(shape: ModelShape, rows: int = 448, repeats: int = 200) -> float:
    """Multiply-adds a second of the bf16 panel product over one layer's q/k/v weights, small
    enough to stay in the cores' L2 with its rows."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, shape.hidden, generator=generator)
    weight = torch.randn(shape.qkv_features, shape.hidden, generator=generator) * 0.02
    panels = pack_panels(weight, torch.bfloat16)
    seconds = best_seconds(
        lambda: cpu_ops.panel_linear(x, panels, None, shape.qkv_features), repeats
    )
    return rows * shape.hidden * shape.qkv_features / seconds


def read_rate(megabytes: int = 512, repeats: int = 7) -> float:
    """Bytes a second a plain sum reads, over far more memory than the caches hold."""
    values = torch.ones(megabytes * (1 << 20) // 4)
    return values.numel() * 4 / best_seconds(lambda: values.sum(), repeats)


def wave_ceilings(
    shape: ModelShape,
    concurrency: int,
    input_len: int,
    output_len: int,
    macs_per_s: float,
    bytes_per_s: float,
) -> dict[str, float]:
    """Output tokens a second of one wave, both ways a decode step is bounded."""
    prompt_attention = concurrency * shape.attention_macs(input_len * (input_len + 1) // 2)
    prefill = (
        concurrency * (input_len * shape.linear_macs() + shape.head_macs()) + prompt_attention
    ) / macs_per_s
    # Every decode step multiplies the same rows by the same weights; only the keys grow.
    products = concurrency * (shape.linear_macs() + shape.head_macs())
    weights = shape.weight_bytes()
    overlapped = attention_after = prefill
    for step in range(1, output_len):
        keys = input_len + step
        attention = concurrency * shape.attention_macs(keys)
        kv = concurrency * keys * shape.kv_bytes()
        overlapped += max((products + attention) / macs_per_s, (weights + kv) / bytes_per_s)
        attention_after += max(products / macs_per_s, weights / bytes_per_s) + max(
            attention / macs_per_s, kv / bytes_per_s
        )
    tokens = concurrency * output_len
    return {
        "overlapped": round(tokens / overlapped, 1),
        "attention_after": round(tokens / attention_after, 1),
        "prefill_s": round(prefill, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a model folder (default: the default model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    if not cpu_ops.load() or not cpu_ops.bf16_panels_available():
        raise SystemExit("the bf16 panel products need AVX-512 BF16 and Conveyor's CPU kernels")
    shape = ModelShape.of(args.model or str(ensure_default_model()))
    macs_per_s, bytes_per_s = product_rate(shape), read_rate()
    print(
        json.dumps(
            {
                "product_gmac_per_s": round(macs_per_s / 1e9, 1),
                "read_gb_per_s": round(bytes_per_s / 1e9, 1),
                "gmac_per_token": round((shape.linear_macs() + shape.head_macs()) / 1e9, 4),
                "weight_mb": round(shape.weight_bytes() / 1e6, 1),
                "kv_kb_per_token": round(shape.kv_bytes() / 1e3, 1),
            }
        )
    )
    for concurrency in args.concurrency:
        ceilings = wave_ceilings(
            shape, concurrency, args.input_len, args.output_len, macs_per_s, bytes_per_s
        )
        print(json.dumps({"concurrency": concurrency, **ceilings}))


if __name__ == "__main__":
    main()
