"""`conveyor collect-env` and `conveyor --version`: what a bug report needs, read from this very
machine and install."""

from __future__ import annotations

import json

import pytest
import torch

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
from server.cli import main
from server.version import conveyor_version


def test_the_report_holds_this_install_and_machine(capsys, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CPU_KERNELS_TEST_MARK", "1")
    monkeypatch.setenv("UNRELATED_VARIABLE", "1")
    assert main(["collect-env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["conveyor"] == conveyor_version()
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["cuda_available"] == torch.cuda.is_available()
    assert report["packages"]["transformers"] != "not installed"
    assert report["environment"]["CONVEYOR_CPU_KERNELS_TEST_MARK"] == "1"
    assert "UNRELATED_VARIABLE" not in report["environment"]
    flags = cpu_build.cpu_flags()
    assert all(feature in flags for feature in report["cpu"]["features"])
    kernels = report["cpu_kernels"]
    if cpu_build.why_unsupported():
        assert kernels["unsupported"] == cpu_build.why_unsupported()
    else:
        result = cpu_ops.build_result()
        assert kernels["built"] == list(result.built) and kernels["failed"] == result.failed
        assert kernels["march"] == cpu_build.march()


def test_the_plain_report_and_a_report_without_a_build(capsys):
    assert main(["collect-env", "--no-build"]) == 0
    text = capsys.readouterr().out
    assert f"conveyor: {conveyor_version()}" in text
    assert f"  version: {torch.__version__}" in text and "built:" not in text


def test_the_version_flag_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["--version"])
    assert ended.value.code == 0
    assert capsys.readouterr().out.strip() == conveyor_version()
