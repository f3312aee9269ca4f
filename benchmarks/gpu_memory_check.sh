#!/usr/bin/env bash
# GPU memory sized by measurement: serve random weights (`--load-format dummy`, nothing read
# from disk) of a model that takes most of the card at the default --gpu-memory-utilization
# 0.9, load it with long prompts at concurrency 64, and report the start-up breakdown (weights,
# activations peak, graphs, KV cache), the device memory in use and whether every request
# finished. The default shape is Llama-70B's with 64 layers: about 55B parameters, 102 GiB in
# bf16, for a 141 GB H200 (fewer layers for a smaller card).
#
#   bash benchmarks/gpu_memory_check.sh [LAYERS] [OUT]
#
# SHAPE overrides the config fields and PROMPTS the number of requests (a dry run on a CPU:
# SHAPE="hidden_size=256 intermediate_size=512 num_attention_heads=4 num_key_value_heads=2
# head_dim=64" PROMPTS=8, LAYERS 2). With no network, LIKE names a folder with the default
# model's config and tokenizer (`offline_kit.sh pack`).
set -euo pipefail
LAYERS=${1:-64}
OUT=${2:-benchmarks/results/gpu_memory}
MODEL=${MODEL:-/tmp/gpu_memory_model}
PORT=${PORT:-8412}
PROMPTS=${PROMPTS:-128}
read -r -a FIELDS <<< "${SHAPE:-hidden_size=8192 intermediate_size=28672 num_attention_heads=64 num_key_value_heads=8 head_dim=128}"
mkdir -p "$OUT"
python benchmarks/random_weights.py "$MODEL" --config-only --dtype bfloat16 \
    ${LIKE:+--like "$LIKE"} --set "${FIELDS[@]}" "num_hidden_layers=$LAYERS"
# shellcheck source=benchmarks/serving.sh
source "$(dirname "$0")/serving.sh"

device_memory() {
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
    else
        echo "no nvidia-smi"
    fi
}

start_server "$OUT/serve.log" --model "$MODEL" --load-format dummy --dtype bfloat16 \
    --port "$PORT" --max-model-len 4096
echo "idle: $(device_memory)" > "$OUT/memory.txt"
conveyor bench serve --base-url "http://127.0.0.1:$PORT" --tokenizer "$MODEL" --ignore-eos \
    --random-input-len 2048 --random-output-len 128 --max-concurrency 64 --num-prompts "$PROMPTS" \
    --seed 7 --json "$OUT/bench.json" > "$OUT/bench.txt"
echo "loaded: $(device_memory)" >> "$OUT/memory.txt"
stop_server
grep -E "memory|KV cache|routes" "$OUT/serve.log" || true
cat "$OUT/memory.txt"
python - "$OUT/bench.json" <<'EOF'
import json
import sys

result = json.load(open(sys.argv[1]))
print({k: result.get(k) for k in ("completed", "failed", "output_throughput", "mean_ttft_ms")})
EOF
