"""The layers keep to their side: the HTTP server and every module of the engine's core and of its
structured outputs load no torch, the scheduling modules and the block manager neither torch nor
transformers, and the engine never imports the server. Checked in a fresh interpreter, so the
imports are real."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def modules_of(package: str) -> list[str]:
    """Every module of `package`, found on disk, so that a module added later is checked too."""
    folder = ROOT.joinpath(*package.split("."))
    return [
        f"{package}.{path.stem}" for path in sorted(folder.glob("*.py")) if path.stem != "__init__"
    ]


def loaded_after_import(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return {name.split(".")[0] for name in result.stdout.split()}


BOUNDARIES = [
    *(
        (module, {"torch"})
        for module in [
            "server.app",
            "server.cli",
            *modules_of("engine.core"),
            *modules_of("engine.structured"),
        ]
    ),
    *(
        (module, {"torch", "transformers"})
        for module in [
            *modules_of("engine.scheduling"),
            "engine.kv.block_manager",
            "engine.kv.block_hash",
            "engine.lora.registry",
        ]
    ),
]


def test_the_boundaries_cover_the_layers():
    assert {
        "engine.core.engine_core",
        "engine.core.async_engine",
        "engine.scheduling.scheduler",
    } <= {module for module, _ in BOUNDARIES}


@pytest.mark.parametrize(("module", "forbidden"), BOUNDARIES)
def test_a_layer_loads_nothing_below_it(module, forbidden):
    assert not loaded_after_import(module) & forbidden


def test_the_engine_never_imports_the_server():
    for path in (ROOT / "engine").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n == "server" or n.startswith("server.") for n in names), path


def test_importing_the_engine_installs_no_warning_filter_of_its_own():
    """Conveyor's process-wide settings are made at start-up (`create_engine_core`), not on
    import; torch and numpy install filters of their own when imported, which are left out."""
    code = (
        "import warnings; before = list(warnings.filters); "
        "import engine.kernels.cpu.linear, engine.factory, server.app; "
        "print([str(f[1].pattern) for f in warnings.filters "
        "if f not in before and f[1] is not None])"
    )
    result = subprocess.run(
        [sys.executable, "-W", "default", "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "fbgemm" not in result.stdout
