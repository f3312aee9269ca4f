#!/usr/bin/env bash
# Conveyor and llama.cpp's server serving the same GGUF file on this machine, one after the
# other, loaded by the same `conveyor bench serve` runs (128-token random prompts, 128 output
# tokens, EOS ignored, fresh prompts per run). Never run in CI.
#
#   LLAMA_SERVER=/path/to/llama-server bash benchmarks/gguf_side_by_side.sh FILE.gguf
#   SERVERS="conveyor-fp32 conveyor-bf16" bash benchmarks/gguf_side_by_side.sh FILE.gguf
#   DENSE=/path/to/hf-folder SERVERS=dense-fp32 bash benchmarks/gguf_side_by_side.sh FILE.gguf
#   SERVERS=conveyor-fp32 CONVEYOR_ARGS=--int8-activations CONVEYOR_TAG=int8 \
#       bash benchmarks/gguf_side_by_side.sh FILE.gguf      # extra serve flags, own files
#
# Servers: `llama.cpp` (llama-server, a thread per core, 16 slots), `conveyor-fp32`
# (`--dtype float32`: the file's blocks in the panel product), `conveyor-bf16` (`--dtype
# bfloat16`: bf16 panels, AVX-512 BF16 / AMX CPUs only) and `dense-fp32` (the Hugging Face
# folder `$DENSE` the file was made from, in fp32 panels: the same shape without blocks).
#
# llama.cpp ships on PyPI as the source of llama-cpp-python; its server builds from there:
#   pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
#   cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DLLAMA_CURL=OFF \
#       -DCMAKE_BUILD_TYPE=Release && cmake --build build --target llama-server -j
# A GGUF file of a random-weight model in any llama.cpp type comes from
# `benchmarks/random_weights.py OUT --dtype float32`, llama.cpp's `convert_hf_to_gguf.py OUT
# --outtype f32` and its `llama-quantize` (build that target too).
#
# Results land in $OUT (default benchmarks/results/gguf_side_by_side) as one JSON per server and
# concurrency, and a table is printed at the end.
set -euo pipefail

FILE=${1:?usage: gguf_side_by_side.sh FILE.gguf}
OUT=${OUT:-benchmarks/results/gguf_side_by_side}
PORT=${PORT:-8300}
SERVERS=${SERVERS:-llama.cpp conveyor-fp32}
LLAMA_SERVER=${LLAMA_SERVER:-llama-server}
THREADS=${THREADS:-$(nproc)}
CONVEYOR_ARGS=${CONVEYOR_ARGS:-}
RUNS=${RUNS:-"1:8 16:48 64:128"}
mkdir -p "$OUT"
tokenizer=$(python -c "from engine.loading.model_loader import checkpoint_path as c; print(c('$FILE'))")

wait_healthy() {  # while the server started last runs
    for _ in $(seq 600); do
        curl -sf "localhost:$PORT/health" > /dev/null && return 0
        kill -0 "$pid" 2> /dev/null || break
        sleep 1
    done
    echo "server on port $PORT did not come up; see $OUT" >&2
    return 1
}

bench() {  # NAME: every server gets the same prompts, different ones per run
    for run in $RUNS; do
        concurrency=${run%%:*}
        prompts=${run##*:}
        conveyor bench serve --base-url "http://localhost:$PORT" --ignore-eos \
            --tokenizer "$tokenizer" --model default \
            --random-input-len 128 --random-output-len 128 --max-concurrency "$concurrency" \
            --num-prompts "$prompts" --seed "$((100 + concurrency))" \
            --json "$OUT/$1_c$concurrency.json" > /dev/null
    done
}

pid=
stop() {
    [ -n "$pid" ] || return 0
    kill -TERM "$pid" 2> /dev/null || true
    wait "$pid" 2> /dev/null || true
    pid=
}
trap stop EXIT

run_server() {  # NAME COMMAND...: serve, bench, stop
    local name=$1
    shift
    if curl -sf "localhost:$PORT/health" > /dev/null; then
        echo "something already serves port $PORT" >&2
        exit 1
    fi
    "$@" > "$OUT/$name.log" 2>&1 &
    pid=$!
    wait_healthy && bench "$name"
    stop
}

for server in $SERVERS; do
    case "$server" in
        llama.cpp)
            run_server "$server" "$LLAMA_SERVER" -m "$FILE" --port "$PORT" -t "$THREADS" \
                -np 16 -c $((16 * 320)) --alias default ;;
        conveyor-fp32 | conveyor-bf16)
            dtype=$([ "$server" = conveyor-fp32 ] && echo float32 || echo bfloat16)
            # shellcheck disable=SC2086  # CONVEYOR_ARGS holds several flags
            run_server "$server${CONVEYOR_TAG:+-$CONVEYOR_TAG}" conveyor serve --model "$FILE" \
                --dtype "$dtype" --port "$PORT" --served-model-name default $CONVEYOR_ARGS ;;
        dense-fp32)
            run_server "$server" conveyor serve --model "${DENSE:?set DENSE}" \
                --dtype float32 --port "$PORT" --served-model-name default ;;
        *) echo "unknown server: $server" >&2; exit 1 ;;
    esac
done

python - "$OUT" <<'EOF'
import json
import pathlib
import sys

print(f"{'server':14} {'conc':>4} {'out tok/s':>10} {'TPOT p50':>9} {'TTFT p50':>9}")
for path in sorted(pathlib.Path(sys.argv[1]).glob("*_c*.json")):
    server, _, conc = path.stem.rpartition("_")
    r = json.loads(path.read_text())
    print(f"{server:14} {conc[1:]:>4} {r['output_throughput']:10.1f} "
          f"{r['p50_tpot_ms']:8.0f}ms {r['p50_ttft_ms'] / 1000:8.2f}s")
EOF
