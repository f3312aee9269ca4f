"""Peak memory of converting and loading a GGUF file, each in a fresh process: Conveyor's
conversion (tensors read and written one at a time, quantized layers kept as blocks only)
against transformers' own loading of the same file (every weight dequantized at once), and
Conveyor's load of the converted folder with its quantized layers held as blocks from the start
against a plain conversion (fp32 weights too) loaded whole before its layers take their blocks.

    PYTHONPATH=. python benchmarks/load_memory.py --hidden 2048 --layers 16

With no `--gguf`, a random Llama of the given shape is written in Q4_0 (a Q8_0 embedding) to a
scratch folder first. Figures are peak resident memory (VmHWM) of each process less the
same process's resident memory once its imports were done.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# Each in a fresh process: transformers' own loading of the file; Conveyor's conversion and its
# load, holding the blocks only; a plain conversion (every weight in fp32 as well) loaded whole
# before its layers take their blocks, as releases before block-only folders did.
STEPS = ("transformers_gguf", "convert", "load_blocks", "convert_plain", "load_plain_whole")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gguf", type=Path, help="a GGUF file (default: a random Llama)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--step", choices=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step:
        print(json.dumps(run_step(args.step, args.gguf, args.folder)))
        return
    with tempfile.TemporaryDirectory(prefix="load-memory-") as scratch:
        work = Path(scratch)
        gguf = args.gguf or write_random_gguf(work, args.hidden, args.intermediate, args.layers)
        folder = work / "converted"
        size = gguf.stat().st_size
        print(f"{gguf.name}: {size / 2**30:.2f} GiB")
        for step in STEPS:
            plain = step.endswith(("_plain", "_plain_whole"))
            extra = ["--folder", str(work / "plain" if plain else folder)]
            command = [sys.executable, __file__, "--step", step, "--gguf", str(gguf), *extra]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            found = json.loads(out.strip().splitlines()[-1])
            grown = found["peak"] - found["base"]
            print(
                f"{step:18s} peak {found['peak'] / 2**30:6.2f} GiB, {grown / 2**30:6.2f} GiB "
                f"over imports ({grown / size:4.1f}x the file), {found['seconds']:.1f} s"
            )
            if step.startswith("convert"):
                written = Path(extra[1])
                stored = sum(p.stat().st_size for p in written.rglob("*") if p.is_file())
                print(f"{'':18s} converted folder {stored / 2**30:.2f} GiB")


def write_random_gguf(work: Path, hidden: int, intermediate: int, layers: int) -> Path:
    from gguf import GGMLQuantizationType as QType
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.gguf_files import write_gguf
    from tests.helpers import chat_tokenizer

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    path = work / "random-llama.Q4_0.gguf"

    def types(name: str) -> QType:
        return QType.Q8_0 if name.startswith("token_embd") else QType.Q4_0

    write_gguf(path, model, chat_tokenizer(), types)
    return path


def run_step(step: str, gguf: Path, folder: Path) -> dict[str, float]:
    import time

    from transformers import AutoModelForCausalLM

    from engine.loading import gguf_file
    from engine.loading.model_loader import (
        LinearForm,
        load_model,
        use_linear_form,
    )

    base = rss()
    start = time.perf_counter()
    if step == "transformers_gguf":
        AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    elif step.startswith("convert"):
        gguf_file.convert(gguf, folder, gguf.stem, plain=step == "convert_plain")
    elif step == "load_blocks":
        load_model(str(folder), torch.float32, torch.device("cpu"))
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        use_linear_form(model, LinearForm.FP32_PANELS, folder)
    seconds = time.perf_counter() - start
    return {"base": base, "peak": peak(), "seconds": seconds}


def rss() -> float:
    """Resident bytes now."""
    fields = Path("/proc/self/statm").read_text().split()
    return int(fields[1]) * resource.getpagesize()


def peak() -> float:
    """Peak resident bytes of this process's memory (VmHWM: ru_maxrss would carry the peak
    of the process this one was forked from)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


if __name__ == "__main__":
    main()
