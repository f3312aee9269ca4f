#!/usr/bin/env bash
# The overload benchmark: fcfs against priority scheduling at twice the measured capacity.
#
#   bash benchmarks/overload.sh [PAIRS]      # default: 2 pairs of runs, about 8 minutes
#
# It measures the capacity (64-token prompts, 32 output tokens, 32 at a time) and the unloaded
# TTFT, then loads the server at twice the capacity for 60 s (20% of requests at priority 0,
# a 20 s deadline on every request), alternating fcfs and priority runs so that drifts in the
# machine's speed hit both policies alike. Results land in $OUT (default
# benchmarks/results/overload) as one JSON per run.
set -euo pipefail
source "$(dirname "$0")/serving.sh"

OUT=${OUT:-benchmarks/results/overload}
PORT=${PORT:-8400}
PAIRS=${1:-2}
SERVE=(--max-num-seqs 32 --max-waiting-requests 64 --max-priority-wait 30 --port "$PORT")
LOAD=(--base-url "http://127.0.0.1:$PORT" --random-input-len 64 --random-output-len 32
      --ignore-eos)
mkdir -p "$OUT"

serve() {  # policy
    start_server "$OUT/serve_$1.log" "${SERVE[@]}" --scheduling-policy "$1"
}


serve fcfs
conveyor bench serve "${LOAD[@]}" --max-concurrency 32 --num-prompts 128 --seed 7 \
    --json "$OUT/capacity.json" > /dev/null
rate=$(python -c "import json; print(round(2 * json.load(open('$OUT/capacity.json'))['request_throughput'], 1))")
conveyor bench serve "${LOAD[@]}" --request-rate 0.5 --duration 60 --seed 8 --priority-mix 0.2 \
    --timeout 20 --json "$OUT/unloaded.json" > /dev/null
stop_server
echo "capacity x 2 = $rate requests/s"

for pair in $(seq "$PAIRS"); do
    for policy in fcfs priority; do
        serve "$policy"
        conveyor bench serve "${LOAD[@]}" --request-rate "$rate" --duration 60 --seed 9 \
            --priority-mix 0.2 --timeout 20 --json "$OUT/${policy}_$pair.json" > /dev/null
        stop_server
    done
done

python - "$OUT" "$PAIRS" <<'EOF'
import json
import sys
from pathlib import Path

out, pairs = Path(sys.argv[1]), int(sys.argv[2])
unloaded = json.loads((out / "unloaded.json").read_text())
print(f"unloaded TTFT p50 / p99: {unloaded['p50_ttft_ms'] / 1000:.2f} / "
      f"{unloaded['p99_ttft_ms'] / 1000:.2f} s")
for pair in range(1, pairs + 1):
    for policy in ("fcfs", "priority"):
        result = json.loads((out / f"{policy}_{pair}.json").read_text())["overload"]
        high = result["by_class"]["high"]
        print(f"{policy:<9} run {pair}: goodput {result['deadline_goodput']:.2f} req/s, high "
              f"on time {high['completed_on_time']} of {high['requests']}, high TTFT p50 / p99 "
              f"{high['p50_ttft_ms'] / 1000:.2f} / {high['p99_ttft_ms'] / 1000:.2f} s")
EOF
