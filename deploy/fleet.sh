#!/usr/bin/env bash
# A fleet on one host: N `conveyor serve` replicas on ports 8001..800N and vllm-router in front
# of them on :8000 (cache-aware routing, health checks every 2 s, retries, a circuit breaker). The
# router serves once a replica answers /health (looked for every 2 s while they start); the others
# join as the health checks find them up.
# Ctrl-C or SIGTERM drains and stops them all.
#
#   pip install vllm-router
#   bash deploy/fleet.sh 2 [conveyor serve arguments...]
#
# On CPUs, give each replica its share of the cores (OMP_NUM_THREADS, default: cores / N); on a
# GPU host, pass --gpu-memory-utilization to share one GPU, or set CUDA_VISIBLE_DEVICES per
# replica with FLEET_GPUS="0 1". Replica i runs as data-parallel rank i: its metrics carry
# engine="i", and with --kv-events-config its events go out on the configured ports plus i, as
# vLLM's ranks send theirs. ROUTER_PORT, ROUTER_METRICS_PORT (the router's own Prometheus
# metrics, 29000), FIRST_PORT, POLICY and LOGS override the defaults.
set -euo pipefail

replicas=${1:?usage: deploy/fleet.sh N [conveyor serve arguments...]}
shift
router_port=${ROUTER_PORT:-8000}
metrics_port=${ROUTER_METRICS_PORT:-29000}
first_port=${FIRST_PORT:-8001}
policy=${POLICY:-cache_aware}
logs=${LOGS:-fleet-logs}
read -r -a gpus <<< "${FLEET_GPUS:-}"
threads=${OMP_NUM_THREADS:-$(( $(nproc) / replicas > 0 ? $(nproc) / replicas : 1 ))}
mkdir -p "$logs"

pids=()
stop() {
    trap - INT TERM EXIT
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
}
trap stop INT TERM EXIT

urls=()
for ((i = 0; i < replicas; i++)); do
    port=$((first_port + i))
    gpu=${gpus[i]:-${CUDA_VISIBLE_DEVICES:-}}
    CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=$threads \
        conveyor serve --port "$port" --data-parallel-size "$replicas" --data-parallel-rank "$i" \
        "$@" > "$logs/replica-$i.log" 2>&1 &
    pids+=($!)
    urls+=("http://127.0.0.1:$port")
done

vllm-router --worker-urls "${urls[@]}" --host 0.0.0.0 --port "$router_port" \
    --prometheus-host 0.0.0.0 --prometheus-port "$metrics_port" \
    --policy "$policy" --health-check-interval-secs 2 --cb-timeout-duration-secs 5 \
    --cb-failure-threshold 3 \
    --worker-startup-timeout-secs 1800 --worker-startup-check-interval 2 > "$logs/router.log" 2>&1 &
pids+=($!)
echo "router on :$router_port in front of ${urls[*]} (logs in $logs/)"
wait -n "${pids[@]}" || true
echo "a fleet process exited; stopping the rest" >&2
