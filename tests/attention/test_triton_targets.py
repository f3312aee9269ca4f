"""Conveyor's Triton kernels compile for Ampere (sm_80) and Hopper (sm_90) on any host: Triton
carries its own `ptxas`, so a kernel the interpreter runs but a GPU compiler rejects fails here,
not first on a GPU host. Run in a fresh interpreter without `TRITON_INTERPRET` (this suite's
other Triton tests run in the interpreter, where nothing is compiled)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed on this platform")

ROOT = Path(__file__).resolve().parents[2]


def compiling_env() -> dict[str, str]:
    """This environment less the interpreter switch, Triton's fusion default said outright."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, "TRITON_DEFAULT_FP_FUSION": "1"}


def test_every_kernel_form_compiles_for_ampere_and_hopper():
    result = subprocess.run(
        [sys.executable, "-m", "engine.kernels.triton.targets", "80", "90"],
        cwd=ROOT,
        env=compiling_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 of the forms failed" in result.stdout


def test_a_form_the_target_cannot_take_is_reported():
    """e4m3 has no conversions on Ampere: asked for anyway, the compile fails and says so."""
    code = (
        "from engine.kernels.triton import targets; targets.E4M3_FROM = 0; "
        "print('\\n'.join(f for f in targets.compile_for(80) if 'store' in f))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=compiling_env(), capture_output=True, text=True
    )
    assert "fp8e4nv not supported in this architecture" in result.stdout, result.stderr
