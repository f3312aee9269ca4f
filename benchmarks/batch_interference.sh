#!/usr/bin/env bash
# What a running batch costs live traffic: the default model served and loaded by
# `conveyor bench serve` at concurrency 4 (after a warm-up run) without a batch, then again
# while a 1,000-line batch runs; prints live TTFT / TPOT p50 and p99 for both and the batch's
# throughput meanwhile.
#
#   bash benchmarks/batch_interference.sh      # about 3 minutes
#
# Results land in $OUT (default benchmarks/results/batch) as one JSON per run.
set -euo pipefail
source "$(dirname "$0")/serving.sh"

OUT=${OUT:-benchmarks/results/batch}
PORT=${PORT:-8400}
URL="http://127.0.0.1:$PORT"
LOAD=(--base-url "$URL" --random-input-len 128 --random-output-len 64 --ignore-eos
      --max-concurrency 4 --num-prompts "${NUM_PROMPTS:-48}")
mkdir -p "$OUT"
rm -rf "$OUT/state"

start_server "$OUT/serve.log" --port "$PORT" --state-dir "$OUT/state"
trap 'kill -TERM $server 2>/dev/null || true' EXIT

# Each run its own prompts (seeds), so that none finds another's in the prefix cache.
conveyor bench serve "${LOAD[@]}" --num-prompts 16 --seed 2 --json "$OUT/warmup.json" > /dev/null
conveyor bench serve "${LOAD[@]}" --seed 3 --json "$OUT/alone.json" > /dev/null
python - "$URL" "$OUT" <<'PY'
import json
import sys

from openai import OpenAI

url, out = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=f"{url}/v1", api_key="unused")
model = client.models.list().data[0].id
lines = "".join(
    json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                "body": {"model": model, "prompt": f"Write about item {i}:", "max_tokens": 64,
                         "ignore_eos": True}}) + "\n"
    for i in range(1000)
)
upload = client.files.create(file=("batch.jsonl", lines.encode()), purpose="batch")
batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                              completion_window="24h")
open(f"{out}/batch_id", "w").write(batch.id)
PY
sleep 5  # the batch fills the engine first
before=$(curl -s "$URL/v1/batches/$(cat "$OUT/batch_id")" | python -c "import json,sys; print(json.load(sys.stdin)['request_counts']['completed'])")
start=$(date +%s.%N)
conveyor bench serve "${LOAD[@]}" --seed 4 --json "$OUT/with_batch.json" > /dev/null
end=$(date +%s.%N)
after=$(curl -s "$URL/v1/batches/$(cat "$OUT/batch_id")" | python -c "import json,sys; print(json.load(sys.stdin)['request_counts']['completed'])")
curl -s -X POST "$URL/v1/batches/$(cat "$OUT/batch_id")/cancel" > /dev/null

python - "$OUT" "$before" "$after" "$start" "$end" <<'PY'
import json
import sys
from pathlib import Path

out, before, after, start, end = Path(sys.argv[1]), *map(float, sys.argv[2:])
for name in ("alone", "with_batch"):
    r = json.loads((out / f"{name}.json").read_text())
    print(f"{name:<10} TTFT p50 {r['p50_ttft_ms']:.0f} ms, p99 {r['p99_ttft_ms']:.0f} ms; "
          f"TPOT p50 {r['p50_tpot_ms']:.1f} ms, p99 {r['p99_tpot_ms']:.1f} ms; "
          f"output {r['output_throughput']:.1f} tok/s")
lines = after - before
print(f"batch meanwhile: {lines:.0f} lines in {end - start:.1f} s "
      f"({lines / (end - start):.2f} lines/s, {64 * lines / (end - start):.1f} tok/s)")
PY
