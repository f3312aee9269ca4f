#!/usr/bin/env bash
# What request tracing costs: the default model served without and with
# --otlp-traces-endpoint (spans to a local sink), loaded in turn by the same
# `conveyor bench serve` run at concurrency 16, alternating so that drifts in the machine's
# speed hit both alike.
#
#   bash benchmarks/tracing_overhead.sh [PAIRS]      # default: 4 pairs, about 5 minutes
#
# Results land in $OUT (default benchmarks/results/tracing) as one JSON per run.
set -euo pipefail
source "$(dirname "$0")/serving.sh"

OUT=${OUT:-benchmarks/results/tracing}
PORT=${PORT:-8400}
SINK=${SINK:-4318}
PAIRS=${1:-4}
LOAD=(--base-url "http://127.0.0.1:$PORT" --random-input-len 128 --random-output-len 128
      --ignore-eos --max-concurrency 16 --num-prompts "${NUM_PROMPTS:-128}")
mkdir -p "$OUT"

python benchmarks/otlp_sink.py --port "$SINK" &
sink=$!
trap 'kill $sink 2>/dev/null || true' EXIT

for pair in $(seq "$PAIRS"); do
    start_server "$OUT/serve_off.log" --port "$PORT"
    conveyor bench serve "${LOAD[@]}" --seed "$pair" --json "$OUT/off_$pair.json" > /dev/null
    stop_server
    start_server "$OUT/serve_on.log" --port "$PORT" \
        --otlp-traces-endpoint "http://127.0.0.1:$SINK/v1/traces"
    conveyor bench serve "${LOAD[@]}" --seed "$pair" --json "$OUT/on_$pair.json" > /dev/null
    stop_server
done
echo "spans received: $(curl -s "http://127.0.0.1:$SINK/count")"

python - "$OUT" "$PAIRS" <<'PY'
import json
import sys
from pathlib import Path

out, pairs = Path(sys.argv[1]), int(sys.argv[2])
for pair in range(1, pairs + 1):
    off, on = (json.loads((out / f"{v}_{pair}.json").read_text()) for v in ("off", "on"))
    ratio = on["output_throughput"] / off["output_throughput"]
    print(f"pair {pair}: output tok/s off {off['output_throughput']:.1f}, "
          f"on {on['output_throughput']:.1f} (on/off {ratio:.3f}); TTFT p50 off "
          f"{off['p50_ttft_ms']:.0f} ms, on {on['p50_ttft_ms']:.0f} ms")
PY
