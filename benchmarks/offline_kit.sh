#!/usr/bin/env bash
# Runs Conveyor's GPU benchmarks on a Linux x86-64 host with no network whose Python already
# has torch, Triton, transformers and the usual scientific stack (a CUDA image).
#
#   bash benchmarks/offline_kit.sh pack DIR [PYTHON_VERSION]   # here, with network
#   bash benchmarks/offline_kit.sh install DIR                 # on the host, in this repository
#
# `pack` writes DIR/wheels (what `conveyor serve`, `conveyor bench serve` and the CUDA tests
# need beyond that stack, for the host's Python, default 3.12; about 35 MB) and DIR/like
# (the default model's config and tokenizer files, no weights: `random_weights.py --like
# DIR/like` then makes a model of its shape on the host). `install` installs this repository
# (editable, so `conveyor` is on the PATH) from those wheels without reaching any index.
set -euo pipefail

# What the host lacks: Conveyor's requirements beyond torch, transformers and their own stack,
# and the test suite's asyncio and xdist plugins. `pack` downloads them with everything they
# need; `install` takes from those wheels only what the host's Python does not already satisfy.
WANTED=(
    "fastapi>=0.110" "uvicorn[standard]>=0.29" "pydantic>=2.6" "prometheus-client>=0.20"
    "httpx>=0.27" "aiohttp>=3.9" "gguf>=0.10" "llguidance>=1.3,<2" "jsonschema>=4"
    "python-multipart>=0.0.9" "pyyaml>=6" "pytest-asyncio>=0.24" "pytest-xdist>=3.5"
)
PLATFORMS=(manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28
    manylinux_2_31 manylinux_2_34 manylinux_2_35)

pack() {
    local dir=$1 python_version=${2:-3.12}
    local platform_args=()
    for platform in "${PLATFORMS[@]}"; do
        platform_args+=(--platform "${platform}_x86_64")
    done
    mkdir -p "$dir/wheels" "$dir/like"
    python -m pip download --quiet --only-binary=:all: --implementation cp \
        --python-version "$python_version" "${platform_args[@]}" -d "$dir/wheels" "${WANTED[@]}"
    # PEFT, the LoRA tests' oracle, without its requirements (torch among them).
    python -m pip download --quiet --no-deps -d "$dir/wheels" "peft>=0.13"
    python - "$dir/like" <<'EOF'
import shutil
import sys
from pathlib import Path

from engine.loading.default_model import ensure_default_model

source = Path(ensure_default_model())
for path in source.iterdir():
    if path.is_file() and path.suffix != ".safetensors" and not path.name.endswith(".gguf"):
        shutil.copy(path, sys.argv[1])
EOF
    du -sh "$dir"
}

install() {
    local dir=$1
    python3 -m pip install --quiet --no-index --find-links "$dir/wheels" --no-build-isolation \
        -e . pytest-asyncio pytest-xdist
    python3 -c "import fastapi, llguidance, server.app" && command -v conveyor
    python3 -m pip install --quiet --no-index --find-links "$dir/wheels" peft \
        || echo "PEFT's requirements are missing here: the LoRA tests will be skipped" >&2
    if ! command -v python > /dev/null; then
        echo "the scripts call 'python', which is not on the PATH: link it to python3" >&2
        return 1
    fi
}

case "${1:-}" in
    pack) pack "${@:2}" ;;
    install) install "${@:2}" ;;
    *)
        echo "usage: $0 pack DIR [PYTHON_VERSION] | install DIR" >&2
        exit 2
        ;;
esac
