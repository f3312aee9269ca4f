#!/usr/bin/env bash
# Async scheduling and CUDA graphs on a GPU, in one run: the engine's own decode step with
# steps in turn and overlapped, transformers' continuous batching on the same prompts, and
# served throughput and TPOT each way (under continuous arrivals most steps carry a prompt
# chunk: the piecewise graphs).
# The figure to read: served TPOT p50 at 64 against the overlapped engine's median step at 64.
#
#   bash benchmarks/gpu_async_check.sh [MODEL_DIR] [OUT]
#
# Without MODEL_DIR, /tmp/smol gets the default model's config and tokenizer and no weights:
# every run then takes random ones of that shape (`--load-format dummy`), so a large shape
# writes nothing to disk. A MODEL_DIR with safetensors is read as it is. With no network, LIKE
# names a folder with the default model's config and tokenizer (`offline_kit.sh pack`), and
# SHAPE changes config fields (a Qwen2.5-1.5B-like shape: SHAPE="hidden_size=1536
# intermediate_size=8960 num_attention_heads=12 num_key_value_heads=2 head_dim=128
# num_hidden_layers=28 vocab_size=151936" with another MODEL_DIR). CONCURRENCY overrides the
# concurrencies (a dry run on a CPU: "1 2"). With COMPILE=1 (the default) the engine and the
# server also run with `--compile`, after the eager runs (COMPILE=0 leaves them out: each
# start compiles the layers first, a few seconds on a CPU). The GPU's tests are `gpu_tests.sh`.
set -euo pipefail
MODEL=${1:-/tmp/smol}
OUT=${2:-benchmarks/results/gpu_async}
PORT=${PORT:-8411}
read -r -a LEVELS <<< "${CONCURRENCY:-1 16 64 256}"
mkdir -p "$OUT"
read -r -a FIELDS <<< "${SHAPE:-}"
if [ ! -d "$MODEL" ]; then
    python benchmarks/random_weights.py "$MODEL" --config-only ${LIKE:+--like "$LIKE"} \
        --set "${FIELDS[@]}"
fi
LOAD=()
compgen -G "$MODEL/*.safetensors" > /dev/null || LOAD=(--load-format dummy)
# shellcheck source=benchmarks/serving.sh
source "$(dirname "$0")/serving.sh"

python benchmarks/engine_throughput.py --model "$MODEL" "${LOAD[@]}" --dtype bfloat16 \
    --concurrency "${LEVELS[@]}" --both-schedulings > "$OUT/engine.log"
MODES=(async-scheduling no-async-scheduling)
if [ "${COMPILE:-1}" = 1 ]; then
    python benchmarks/engine_throughput.py --model "$MODEL" "${LOAD[@]}" --dtype bfloat16 \
        --concurrency "${LEVELS[@]}" --both-schedulings --compile > "$OUT/engine_compiled.log"
    MODES+=(compiled)
fi
python benchmarks/transformers_batch.py --model "$MODEL" "${LOAD[@]}" --dtype bfloat16 \
    --concurrency "${LEVELS[@]}" > "$OUT/transformers_batch.log"
for mode in "${MODES[@]}"; do
    flags=("--$mode")
    [ "$mode" = compiled ] && flags=(--async-scheduling --compile)
    start_server "$OUT/serve_$mode.log" --model "$MODEL" "${LOAD[@]}" --dtype bfloat16 \
        --port "$PORT" "${flags[@]}"
    for concurrency in "${LEVELS[@]}"; do
        conveyor bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer "$MODEL" \
            --ignore-eos --random-input-len 128 --random-output-len 128 \
            --max-concurrency "$concurrency" --num-prompts "$((concurrency * 4))" \
            --seed "$((100 + concurrency))" --json "$OUT/${mode}_c$concurrency.json" > /dev/null
    done
    stop_server
done
python benchmarks/summarize_results.py "$OUT" --root "$(dirname "$OUT")" --out "$OUT/summary"
cat "$OUT"/summary/*.md
