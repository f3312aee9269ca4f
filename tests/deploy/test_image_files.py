"""The Docker image holds what `conveyor serve` needs: exactly the paths the Dockerfile copies,
installed into a fresh virtual environment, start a server that answers. No Docker engine runs
here, so the Dockerfile's `COPY` lines are followed instead of the image being built."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers import chat_tokenizer, tiny_llama
from tests.server_utils import free_port

ROOT = Path(__file__).resolve().parents[2]


def copied_paths(dockerfile: Path) -> list[tuple[str, str]]:
    """(source, destination) of each path the Dockerfile copies from the build context into
    the folder it installs from."""
    pairs = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words[:1] != ["COPY"] or any(w.startswith("--from") for w in words):
            continue
        *sources, destination = words[1:]
        for source in sources:
            target = destination + Path(source).name if destination.endswith("/") else destination
            pairs.append((source, target))
    return pairs


def test_the_dockerfile_copies_every_package_the_project_installs():
    copied = {source for source, _ in copied_paths(ROOT / "Dockerfile")}
    pyproject = (ROOT / "pyproject.toml").read_text()
    include = re.search(r"include = \[([^\]]*)\]", pyproject)
    assert include is not None
    packages = {name.strip(' "*') for name in include.group(1).split(",")}
    assert packages <= copied, packages - copied


def image_tree(tmp_path: Path) -> Path:
    """The Dockerfile's `/src`, laid out from its COPY lines."""
    for source, destination in copied_paths(ROOT / "Dockerfile"):
        assert destination.startswith("/src/"), destination
        target = tmp_path / "src" / destination.removeprefix("/src/")
        if (ROOT / source).is_dir():
            shutil.copytree(
                ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / source, target)
    return tmp_path / "src"


def fresh_venv(tmp_path: Path, src: Path) -> Path:
    """A new environment with the project installed from `src` alone; its dependencies are
    this environment's (a path entry, so the editable install of the checkout stays out)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    )
    deps = {sysconfig.get_path("purelib"), str(Path(torch.__file__).parents[1])}
    (Path(purelib.stdout.strip()) / "deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            str(src),
        ],
        check=True,
    )
    return venv


@pytest.mark.e2e
def test_the_image_files_alone_serve_a_model(tmp_path):
    venv = fresh_venv(tmp_path, image_tree(tmp_path))
    where = subprocess.run(
        [venv / "bin" / "python", "-c", "import bench, engine, server; print(engine.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.startswith(str(venv)), where.stdout  # not the checkout's packages

    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    chat_tokenizer().save_pretrained(model_dir)
    port = free_port()
    # Pure torch: the image's kernels compile on first start, as tested elsewhere.
    env = {**os.environ, "CONVEYOR_CACHE": str(tmp_path / "cache"), "CONVEYOR_CPU_KERNELS": "off"}
    server = subprocess.Popen(
        [
            venv / "bin" / "conveyor",
            "serve",
            "--model",
            str(model_dir),
            "--device",
            "cpu",
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--kv-cache-memory",
            "64MiB",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert server.stdout is not None
        log = []
        for line in server.stdout:  # until the server says it is up, or exits
            log.append(line)
            if "Uvicorn running on" in line or "Application startup complete" in line:
                break
        assert server.poll() is None, "".join(log)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={
                "model": "tiny",
                "prompt": "Hello",
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        warnings = [line for line in log if "CPU kernels are not used" in line]
        assert len(warnings) == 1 and "pure torch" in warnings[0], "".join(log)
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=60)
