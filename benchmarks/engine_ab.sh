#!/usr/bin/env bash
# This tree's engine against another tree's (an older commit's files, e.g. from `git archive`),
# in one run: `benchmarks/engine_throughput.py ARGS` in each tree in the order base, this,
# this, base, then each concurrency's output tokens/s per tree (the mean of its two runs) and
# this tree's against the base's. Pass only options both trees' engine_throughput.py know.
#
#   bash benchmarks/engine_ab.sh BASE_TREE [ARGS...]
#
# e.g. `mkdir /tmp/base && git archive REV | tar -x -C /tmp/base`, then
# `bash benchmarks/engine_ab.sh /tmp/base --concurrency 1 16 64`.
#
# Each tree converts a GGUF file or quantized checkpoint into a cache of its own (a conversion is
# keyed by the file, not by the code that made it); both share the compiled kernels (keyed by
# their sources) and the default model's folder.
set -euo pipefail
BASE=$(cd "$1" && pwd)
shift
HERE=$(cd "$(dirname "$0")/.." && pwd)
LOG=$(mktemp)
CACHES=$(mktemp -d)
SHARED=$(cd "$HERE" && python -c 'from engine.core.paths import cache_dir; print(cache_dir())')
DEFAULT_MODEL=$(cd "$HERE" && python -c 'from engine.loading import default_model as d
print(d.DEFAULT_MODEL_NAME)')
mkdir -p "$SHARED/kernels"
for label in base this; do
    mkdir -p "$CACHES/$label/models"
    ln -s "$SHARED/kernels" "$CACHES/$label/kernels"
    if [ -d "$SHARED/models/$DEFAULT_MODEL" ]; then  # else each tree fetches it
        ln -s "$SHARED/models/$DEFAULT_MODEL" "$CACHES/$label/models/$DEFAULT_MODEL"
    fi
done

run_in() {
    local label=$1 tree=$2
    shift 2
    (cd "$tree" && CONVEYOR_CACHE="$CACHES/$label" PYTHONPATH="$tree" \
        python benchmarks/engine_throughput.py "$@") |
        sed "s/^{/{\"tree\": \"$label\", /" | tee -a "$LOG"
}

for label in base this this base; do
    if [ "$label" = base ]; then run_in base "$BASE" "$@"; else run_in this "$HERE" "$@"; fi
done
python - "$LOG" <<'EOF'
import json
import statistics
import sys
from collections import defaultdict

rates = defaultdict(list)
for line in open(sys.argv[1]):
    if line.startswith("{"):
        row = json.loads(line)
        rates[row["concurrency"], row["tree"]].append(row["output_tok_per_s"])
print("| concurrency | base tok/s | this tok/s | this / base |")
print("| --- | --- | --- | --- |")
for concurrency in sorted({c for c, _ in rates}):
    base = statistics.mean(rates[concurrency, "base"])
    this = statistics.mean(rates[concurrency, "this"])
    print(f"| {concurrency} | {base:.1f} | {this:.1f} | {this / base:.2f} |")
EOF
rm -rf "$LOG" "$CACHES"
