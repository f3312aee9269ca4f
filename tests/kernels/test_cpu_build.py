"""How the CPU kernels build: every source for every x86-64 level, groups that fail apart, and
build locks that never outlive their process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.build import GROUPS, build_lock, without

ALL = cpu_build.GROUP_NAMES
UNSUPPORTED = cpu_build.why_unsupported()
needs_compiler = pytest.mark.skipif(bool(UNSUPPORTED), reason=f"no kernels here: {UNSUPPORTED}")


@needs_compiler
def test_every_source_compiles_for_each_instruction_set(tmp_path):
    failures = cpu_build.cross_compile(cpu_build.TARGETS, tmp_path)
    assert not failures, "\n".join(f"{f.source} for {f.target}:\n{f.errors}" for f in failures)


@needs_compiler
def test_a_missing_guard_fails_its_own_source_and_private_names_alike_fail_none(tmp_path):
    """A group compiles as one unit; where that unit fails, each source is compiled alone, so
    only the source that uses AVX-512 without a guard fails for an AVX2 target, not its
    neighbour, and two sources' private names alike (a clash only the unit has) fail nothing."""
    group = tmp_path / "csrc" / "group"
    group.mkdir(parents=True)
    private = "namespace {\nconstexpr int kLanes = %d;\n}\n"
    (group / "guarded.cpp").write_text(
        "#include <immintrin.h>\n" + private % 8 + "__m256 twice(__m256 x) {\n"
        "#ifdef __AVX512F__\n  return x;\n#else\n  return _mm256_add_ps(x, x);\n#endif\n}\n"
    )
    (group / "unguarded.cpp").write_text(
        "#include <immintrin.h>\n"
        + private % 16
        + "__m512 sum(__m512 x) { return _mm512_add_ps(x, x); }\n"
    )
    failures = cpu_build.cross_compile(["haswell"], tmp_path / "work", csrc=tmp_path / "csrc")
    assert [(f.target, f.source) for f in failures] == [("haswell", "unguarded.cpp")]
    assert "_mm512_add_ps" in failures[0].errors
    assert (
        cpu_build.cross_compile(["sapphirerapids"], tmp_path / "wide", csrc=tmp_path / "csrc") == []
    )


@needs_compiler
def test_every_group_builds_for_this_machine():
    result = cpu_ops.build_result()
    assert result.built == ALL, result.failed
    assert result.failed == {}


def test_the_sources_are_exactly_the_groups_sources():
    """Each source sits in its group's folder, and every source on disk belongs to a group."""
    on_disk = sorted(p.relative_to(cpu_build.CSRC) for p in cpu_build.CSRC.rglob("*.cpp"))
    assert sorted(p.relative_to(cpu_build.CSRC) for p in cpu_build.SOURCES) == on_disk
    assert {p.parts[0] for p in on_disk} == set(cpu_build.GROUP_NAMES)


def test_a_group_left_out_takes_the_groups_that_need_it():
    assert without(ALL, {"linear"}) == ("attention", "elementwise", "recurrent")
    assert without(ALL, {"fused_decode"}) == ("attention", "linear", "elementwise", "recurrent")
    assert without(ALL, {"recurrent"}) == ("attention", "linear", "elementwise", "fused_decode")
    assert without(ALL, set()) == ALL


def test_build_name_changes_with_the_cpu_features(monkeypatch):
    name = cpu_build.build_name()
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: "flags : something else")
    assert cpu_build.build_name() != name


class FakeCompiler:
    """Stands in for the compiler: fails any build that includes `broken`, as ninja reports it."""

    def __init__(self, broken: str | None, status: str = "") -> None:
        self.broken = broken
        # What ninja writes between `FAILED:` and the object: nothing before 1.13, then the
        # compiler's exit status (`[code=1] `).
        self.status = status
        self.builds: list[tuple[str, ...]] = []
        self.jobs: list[int | None] = []

    def __call__(
        self, folder: Path, name: str, groups: tuple[str, ...], jobs: int | None = None
    ) -> None:
        self.builds.append(groups)
        self.jobs.append(jobs)
        assert not (folder / "lock").exists(), "a stale baton reached torch's builder"
        if self.broken in groups:
            source = next(g for g in GROUPS if g.name == self.broken).sources[-1]
            stem = source.removesuffix(".cpp")
            path = cpu_build.CSRC / self.broken / source
            raise RuntimeError(
                f"Error building extension '{name}': [1/3] c++ ...\n"
                f"FAILED: {self.status}{stem}.o\n{path}:139:5: error: "
                f"'round_to_bf16' was not declared in this scope\nninja: stop"
            )


@pytest.fixture
def supported(monkeypatch):
    monkeypatch.setattr(cpu_build, "why_unsupported", lambda: "")


@pytest.mark.parametrize("status", ["", "[code=1] "])
def test_one_broken_group_falls_back_alone(supported, monkeypatch, tmp_path, caplog, status):
    fake = FakeCompiler("fused_decode", status)
    monkeypatch.setattr(cpu_build, "_compile", fake)
    with caplog.at_level(logging.WARNING):
        result = cpu_build.build(tmp_path, "conveyor_cpu_test")
    assert result.built == ("attention", "linear", "elementwise", "recurrent")
    assert list(result.failed) == ["fused_decode"]
    reason = result.failed["fused_decode"]
    assert "fused_decode/decode_stack.cpp:139:5: error: 'round_to_bf16'" in reason
    assert fake.builds == [ALL, ("attention", "linear", "elementwise", "recurrent")]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "fused_decode group did not build" in warnings[0]


def test_a_recorded_failure_is_not_compiled_again(supported, monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_build, "_compile", FakeCompiler("linear"))
    first = cpu_build.build(tmp_path, "conveyor_cpu_test")
    assert first.built == ("attention", "elementwise", "recurrent")
    assert first.failed["fused_decode"] == "it needs the linear group"
    recorded = json.loads((tmp_path / "conveyor_cpu_test" / cpu_build.RECORD).read_text())
    assert set(recorded) == {"linear", "fused_decode"}

    again = FakeCompiler(None)
    monkeypatch.setattr(cpu_build, "_compile", again)
    second = cpu_build.build(tmp_path, "conveyor_cpu_test")
    assert again.builds == [("attention", "elementwise", "recurrent")]
    assert second.built == first.built and second.failed == first.failed


class KilledCompiler(FakeCompiler):
    """Stands in for a compiler the system kills (out of memory) while `killed` jobs or more
    compile at once, as ninja reports it."""

    def __init__(self, killed: int) -> None:
        super().__init__(None)
        self.killed = killed

    def __call__(
        self, folder: Path, name: str, groups: tuple[str, ...], jobs: int | None = None
    ) -> None:
        super().__call__(folder, name, groups, jobs)
        if (jobs or 4) >= self.killed:
            raise RuntimeError(
                f"Error building extension '{name}': [3/31] c++ ...\nFAILED: panel_linear.o\n"
                "c++: fatal error: Killed signal terminated program cc1plus\n"
                "compilation terminated.\nninja: build stopped: subcommand failed."
            )


def test_a_killed_compiler_builds_again_one_source_at_a_time(
    supported, monkeypatch, tmp_path, caplog
):
    """Killed while several sources compile at once (a small container's memory), the build
    goes on one at a time, and every group builds; nothing is recorded as failed, and later
    starts build one source at a time from the first."""
    compiler = KilledCompiler(killed=2)
    monkeypatch.setattr(cpu_build, "_compile", compiler)
    with caplog.at_level(logging.WARNING):
        result = cpu_build.build(tmp_path, "conveyor_cpu_test")
    assert result.built == ALL and result.failed == {}
    assert compiler.builds == [ALL, ALL] and compiler.jobs == [None, 1]
    assert "killed (out of memory?)" in caplog.text
    recorded = json.loads((tmp_path / "conveyor_cpu_test" / cpu_build.RECORD).read_text())
    assert recorded == {}

    later = KilledCompiler(killed=2)
    monkeypatch.setattr(cpu_build, "_compile", later)
    assert cpu_build.build(tmp_path, "conveyor_cpu_test").built == ALL
    assert later.jobs == [1]


def test_a_compiler_killed_one_source_at_a_time_is_not_a_lasting_failure(
    supported, monkeypatch, tmp_path
):
    """Killed even one source at a time, the kernels are not used by this start, but nothing
    is recorded against the sources: the next start builds them all."""
    killed = KilledCompiler(killed=1)
    monkeypatch.setattr(cpu_build, "_compile", killed)
    first = cpu_build.build(tmp_path, "conveyor_cpu_test")
    assert first.built == () and killed.jobs == [None, 1]
    assert first.failed == {g: cpu_build.KILLED_REASON for g in ALL}
    assert not (tmp_path / "conveyor_cpu_test" / cpu_build.RECORD).exists()

    again = FakeCompiler(None)
    monkeypatch.setattr(cpu_build, "_compile", again)
    assert cpu_build.build(tmp_path, "conveyor_cpu_test").built == ALL
    assert again.builds == [ALL] and again.jobs == [1]


def test_the_builder_runs_as_many_jobs_as_asked(monkeypatch, tmp_path):
    """`jobs` reaches torch's builder as MAX_JOBS while it runs, and is put back after; such a
    build has a name of its own (torch's builder builds a name once a process)."""
    seen = []

    def load(folder: Path, name: str, groups: tuple[str, ...]) -> None:
        seen.append((name, os.environ.get("MAX_JOBS")))

    monkeypatch.setattr(cpu_build, "_load_extension", load)
    monkeypatch.setenv("MAX_JOBS", "7")
    cpu_build._compile(tmp_path, "conveyor_cpu_test", ALL, 1)
    cpu_build._compile(tmp_path, "conveyor_cpu_test", ALL)
    monkeypatch.delenv("MAX_JOBS")
    cpu_build._compile(tmp_path, "conveyor_cpu_test", ALL, 1)
    assert seen == [
        ("conveyor_cpu_test_j1", "1"),
        ("conveyor_cpu_test", "7"),
        ("conveyor_cpu_test_j1", "1"),
    ]
    assert "MAX_JOBS" not in os.environ


def test_a_failure_no_source_explains_fails_every_group(supported, monkeypatch, tmp_path):
    def no_ninja(folder, name, groups, jobs=None):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpu_build, "_compile", no_ninja)
    result = cpu_build.build(tmp_path, "conveyor_cpu_test")
    assert result.built == ()
    assert result.failed == {g: "Ninja is required to load C++ extensions" for g in ALL}


def test_no_x86_64_builds_nothing_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(cpu_build, "_compile", FakeCompiler(None))
    with caplog.at_level(logging.WARNING):
        result = cpu_build.build(tmp_path, "conveyor_cpu_test")
    assert result.built == ()
    assert all("x86-64 code and this is aarch64" in why for why in result.failed.values())
    assert len(caplog.records) == 1 and "pure torch" in caplog.records[0].getMessage()


def test_no_compiler_builds_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    result = cpu_build.build(tmp_path, "conveyor_cpu_test")
    assert result.built == () and "no C++ compiler" in result.failed["attention"]


HOLDER = """
import sys, time
from pathlib import Path
from engine.kernels.cpu.build import build_lock
folder = Path(sys.argv[1])
with build_lock(folder):
    (folder / "lock").write_text("")  # torch's baton, as a build in progress leaves it
    print("held", flush=True)
    time.sleep(600)
"""


def hold_lock(folder: Path) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)],
        text=True,
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_build_killed_midway_does_not_block_the_next(supported, monkeypatch, tmp_path, caplog):
    folder = tmp_path / "conveyor_cpu_test"
    folder.mkdir()
    holder = hold_lock(folder)
    holder.kill()
    holder.wait()
    assert (folder / "lock").exists()
    monkeypatch.setattr(cpu_build, "_compile", FakeCompiler(None))
    with caplog.at_level(logging.WARNING):
        result = cpu_build.build(tmp_path, "conveyor_cpu_test")
    assert result.built == ALL
    assert not (folder / "lock").exists()
    assert "stopped before it finished" in caplog.text


def test_a_live_build_is_waited_for_and_named(tmp_path, caplog):
    holder = hold_lock(tmp_path)
    acquired = threading.Event()

    def take() -> None:
        with build_lock(tmp_path):
            acquired.set()

    try:
        with caplog.at_level(logging.INFO, logger="engine.kernels.cpu.build"):
            waiter = threading.Thread(target=take, daemon=True)
            waiter.start()
            for _ in range(6000):  # a bound, not a timing: the line comes before any wait
                if f"waiting for process {holder.pid}" in caplog.text:
                    break
                threading.Event().wait(0.01)
            assert f"waiting for process {holder.pid}" in caplog.text
            assert not acquired.is_set()
    finally:
        holder.kill()
        holder.wait()
    waiter.join(timeout=60)
    assert acquired.is_set()
