"""`conveyor collect-env`: what a bug report needs to know of the machine and the install, as
`vllm collect-env` prints it: Conveyor's version, Python and the OS, the CPU and the instruction
sets the kernels care about, which of Conveyor's CPU kernels built here (and why any did not),
torch and its GPUs, the packages serving rests on, and the environment variables that change
what Conveyor does. Plain text, or `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from server.version import conveyor_version

# The CPU features the kernels choose routes by (as /proc/cpuinfo names them).
CPU_FEATURES = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_bf16",
    "avx512_vnni",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
)
PACKAGES = (
    "transformers",
    "tokenizers",
    "safetensors",
    "huggingface_hub",
    "llguidance",
    "triton",
    "fastapi",
    "uvicorn",
    "pydantic",
    "prometheus_client",
)
# Variables that change what Conveyor or torch does.
VARIABLE_PREFIXES = ("CONVEYOR_", "HF_", "CUDA_", "OMP_", "TORCH_")


def collect(build: bool = True) -> dict[str, Any]:
    """The report; with `build`, the CPU kernels are built (once per machine) to say which
    load here."""
    import torch

    return {
        "conveyor": conveyor_version(),
        "python": sys.version.split()[0],
        "os": platform.platform(),
        "cpu": _cpu(),
        "cpu_kernels": _kernels(build),
        "torch": _torch(torch),
        "packages": {name: _version(name) for name in PACKAGES},
        "environment": {
            key: value
            for key, value in sorted(os.environ.items())
            if key.startswith(VARIABLE_PREFIXES)
        },
    }


def _cpu() -> dict[str, Any]:
    from engine.kernels.cpu.build import cpu_flags

    flags = set(cpu_flags().split(":", 1)[-1].split())
    return {
        "model": _cpu_model(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "features": [feature for feature in CPU_FEATURES if feature in flags],
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _kernels(build: bool) -> dict[str, Any]:
    from engine.kernels.cpu import build as cpu_build

    unsupported = cpu_build.why_unsupported()
    if unsupported:
        return {"built": [], "unsupported": unsupported}
    report: dict[str, Any] = {
        "compiler": cpu_build.compiler(),
        "march": cpu_build.march(),
        # The instruction sets the build's `-march` gives the kernels.
        "target_features": sorted(
            f for f in cpu_build.target_features() if f.startswith(("AVX", "AMX", "FMA", "F16C"))
        ),
    }
    if build:
        from engine.kernels.cpu import ops as cpu_ops

        result = cpu_ops.build_result()
        report.update(built=list(result.built), failed=dict(result.failed))
    return report


def _torch(torch: Any) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    devices = []
    if cuda:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(f"{props.name} ({props.total_memory / 2**30:.1f} GiB)")
    return {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "devices": devices,
        "threads": torch.get_num_threads(),
    }


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def as_text(report: dict[str, Any], indent: str = "") -> str:
    lines = []
    for key, value in report.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            lines.append(as_text(value, indent + "  ") if value else f"{indent}  (none)")
        elif isinstance(value, list):
            lines.append(f"{indent}{key}: {', '.join(map(str, value)) or '(none)'}")
        else:
            lines.append(f"{indent}{key}: {value if value is not None else 'none'}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument(
        "--no-build",
        dest="build",
        action="store_false",
        help="say nothing of which CPU kernels load (building them takes a minute the first time)",
    )


def main(args: argparse.Namespace) -> int:
    report = collect(args.build)
    print(json.dumps(report, indent=1) if args.json else as_text(report))
    return 0
