#!/usr/bin/env bash
# The tests that exercise a GPU, on a CUDA host (no network needed): the CUDA-marked tests, and
# every test of the files whose Triton kernels run on the GPU when there is one (in Triton's
# interpreter elsewhere). The default model's tests are left out: that model is fetched. One
# process (`-n 0`): the tests share the one GPU.
#
#   bash benchmarks/gpu_tests.sh [OUT]
#
# Prints each run's last line; the whole logs are OUT/cuda_tests.log and OUT/triton_tests.log.
set -uo pipefail
OUT=${1:-benchmarks/results/gpu_tests}
mkdir -p "$OUT"
mapfile -t TRITON_FILES < <(grep -l TRITON_DEVICE tests/*/test_*.py)
python -m pytest -q -n 0 -p no:cacheprovider -m "cuda and not default_model" tests \
    --ignore=tests/server > "$OUT/cuda_tests.log" 2>&1
tail -n 1 "$OUT/cuda_tests.log"
python -m pytest -q -n 0 -p no:cacheprovider -m "not cuda" "${TRITON_FILES[@]}" \
    > "$OUT/triton_tests.log" 2>&1
tail -n 1 "$OUT/triton_tests.log"
