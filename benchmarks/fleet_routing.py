"""Cache-aware routing against round-robin: two `conveyor serve` replicas of the default model
behind vllm-router, 8 groups of shared ~1k-token prefixes with 4 requests each in shuffled
order, 2 at a time; prints each policy's prefix-cache hit rate (overall and per replica) and
TTFT p50. The prefix caches are flushed between policies.

    PYTHONPATH=. python benchmarks/fleet_routing.py [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from engine.loading.default_model import ensure_default_model
from tests.deploy.fleet import Replica, Router
from tests.deploy.fleet_traffic import shared_prefix_prompts, ttft_p50

NAME = "SmolLM2-135M-Instruct"


def cache_use(replica: Replica) -> tuple[float, float]:
    metrics = replica.metrics()
    return metrics["vllm:prefix_cache_hits_total"], metrics["vllm:prefix_cache_queries_total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", default="1", help="OMP threads per replica")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per policy")
    args = parser.parse_args()
    model = Path(ensure_default_model())
    prompts = shared_prefix_prompts(8, 1000, 4, tokenizer=AutoTokenizer.from_pretrained(model))
    logs = Path(tempfile.mkdtemp(prefix="fleet-"))
    env = {"OMP_NUM_THREADS": args.threads}
    replicas = [Replica(model, logs / f"replica-{i}.log", name=NAME, env=env) for i in range(2)]
    for replica in replicas:
        replica.launch()
    results: dict[str, list[dict]] = {"round_robin": [], "cache_aware": []}
    try:
        for replica in replicas:
            replica.wait()
        for _ in range(args.rounds):
            for policy in results:
                for replica in replicas:
                    httpx.post(f"{replica.url}/flush_cache", timeout=10).raise_for_status()
                before = [cache_use(r) for r in replicas]
                router = Router([r.url for r in replicas], logs / "router.log", policy).start()
                try:
                    p50 = asyncio.run(ttft_p50(router.url, prompts, 2, NAME))
                finally:
                    router.stop()
                use = [
                    (h - h0, q - q0)
                    for (h0, q0), (h, q) in zip(before, map(cache_use, replicas), strict=True)
                ]
                results[policy].append(
                    {
                        "hit_rate": round(sum(h for h, _ in use) / sum(q for _, q in use), 3),
                        "per_replica": [round(h / q, 3) if q else None for h, q in use],
                        "ttft_p50_ms": round(p50 * 1000, 1),
                    }
                )
    finally:
        for replica in replicas:
            if replica.process is not None:
                replica.stop()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
