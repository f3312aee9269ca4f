"""What sleep mode gives back on this machine, and what each transition costs: the default model
(or `--model`) served with its default KV cache, the process's resident memory read from
/proc awake, asleep at each level and awake again, with the seconds each `sleep`, `wake_up`
and a reload of the same weights (`reload_weights`, as `/update_weights_from_disk`) took, and
a check that greedy tokens after each wake-up are those from before.

    PYTHONPATH=. python benchmarks/sleep_memory.py [--model FOLDER] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from engine.core.async_engine import AsyncEngine
from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams

PROMPT = list(range(1000, 1128))
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def resident_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmRSS in /proc/self/status")


async def tokens(engine: AsyncEngine) -> list[int]:
    out: list[int] = []
    async for output in engine.generate(PROMPT, GREEDY):
        out += output.new_token_ids
    return out


async def timed(label: str, action) -> None:
    start = time.perf_counter()
    await action
    print(f"{label:28s} {time.perf_counter() - start:6.2f} s   resident {resident_gib():6.2f} GiB")


async def run(args: argparse.Namespace) -> None:
    config = EngineConfig(model=args.model, dtype=args.dtype, enable_sleep_mode=True)
    engine = AsyncEngine.from_config(config)
    await engine.start()
    try:
        before = await tokens(engine)
        print(f"{'awake':28s} {'':8s}   resident {resident_gib():6.2f} GiB")
        for level in (1, 2):
            await timed(f"sleep level {level}", engine.sleep(level))
            await timed("wake_up", engine.wake_up())
            assert await tokens(engine) == before, f"level {level} changed the greedy tokens"
        path = engine.core.reloader.served_path  # type: ignore[union-attr]
        await timed("reload the same weights", engine.reload_weights(path))
        assert await tokens(engine) == before, "the reload changed the greedy tokens"
    finally:
        await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: Conveyor's)")
    parser.add_argument("--dtype", default="auto")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
