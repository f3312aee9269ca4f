"""Write an AWQ or GPTQ checkpoint of a dense checkpoint folder, its decoder's projections rounded
to each group's levels (the storage of AutoAWQ or GPTQ, not their search), to time a
quantized checkpoint against the dense one it came from where no hub is reachable:

    PYTHONPATH=. python benchmarks/rounded_checkpoint.py /path/to/dense /tmp/awq --method awq
    python benchmarks/engine_throughput.py --model /tmp/awq --dtype float32 --concurrency 1 16 64
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.quantized_checkpoints import Layout, write_quantized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dense", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--method", choices=("awq", "gptq"), default="awq")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--symmetric", action="store_true", help="GPTQ's sym: zeros in the middle")
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.dense, dtype=torch.float32)
    args.out.mkdir(parents=True, exist_ok=True)
    layout = Layout(args.method, args.bits, args.group_size, symmetric=args.symmetric)
    tokenizer = AutoTokenizer.from_pretrained(args.dense)
    count = write_quantized(args.out, model, tokenizer, layout, rounded=True)
    for name in ("generation_config.json", "chat_template.jinja"):
        if (args.dense / name).is_file():
            shutil.copyfile(args.dense / name, args.out / name)
    print(f"{count} layers as {args.method.upper()} {args.bits}-bit groups of {args.group_size}")


if __name__ == "__main__":
    main()
