"""Compiles Conveyor's CPU kernels (`csrc/`) into one extension, in groups that fail apart.

The kernels are compiled on first use with the machine's own compiler for the machine's own
instruction set (`-march=native`); the build folder is keyed by the sources, the flags, the
CPU's features and torch's version, so a cache carried to another CPU builds afresh instead of
crashing on an unknown instruction.

Every source builds on every x86-64 level (wider instructions sit behind guards with a narrower
path; `cross_compile` checks that for any target on any host). Should one group of sources still
fail to build here, that group and the groups that call into it are left out and the rest are
built without them: the failure is logged once with the compiler's reason, recorded beside the
build so that later starts skip it at once, and only those routes fall back to torch.

Builds of one folder are serialised by an advisory lock that the kernel drops with its holder, so
a server killed while it compiled never blocks the next start: the lock file torch's builder
leaves behind in that case is removed, and the build runs again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sysconfig
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch

from engine import folder_lock

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"


@dataclass(frozen=True, slots=True)
class KernelGroup:
    """Sources that build and fall back together; `needs` are the groups they call into."""

    name: str
    sources: tuple[str, ...]
    needs: tuple[str, ...] = ()


GROUPS = (
    KernelGroup("attention", ("paged_decode.cpp", "paged_prefill.cpp", "kv_store.cpp")),
    KernelGroup(
        "linear",
        (
            "panel_linear.cpp",
            "int8_panels.cpp",
            "bf16_panels.cpp",
            "mxfp4_bf16.cpp",
            "block_bf16.cpp",
            "expert_mlps.cpp",
        ),
    ),
    KernelGroup(
        "elementwise",
        (
            "rms_norm.cpp",
            "rotary.cpp",
            "silu_mul.cpp",
            "argmax.cpp",
            "token_mask.cpp",
            "nucleus_draw.cpp",
            "denormals.cpp",
        ),
    ),
    KernelGroup(
        "fused_decode",
        ("decode_layer.cpp", "decode_stack.cpp"),
        needs=("attention", "linear", "elementwise"),
    ),
    KernelGroup(
        "recurrent", ("delta_rule.cpp", "short_conv.cpp", "ssd_decode.cpp", "mamba1_scan.cpp")
    ),
)
GROUP_NAMES = tuple(group.name for group in GROUPS)
# Each group's sources sit in the folder named after it; the headers they share in `include/`.
SOURCES = [CSRC / group.name / name for group in GROUPS for name in group.sources]
INCLUDE = CSRC / "include"
# Included by the sources: part of the build's key, though not compiled on their own.
HEADERS = sorted(INCLUDE.glob("*.h"))
# `-march` of the build: the machine's own instruction set, or another level to build for
# (`CONVEYOR_CPU_MARCH=haswell` runs the AVX2 routes on a wider machine).
MARCH_VARIABLE = "CONVEYOR_CPU_MARCH"
# `CONVEYOR_CPU_KERNELS=off` serves on pure torch without building anything.
SWITCH_VARIABLE = "CONVEYOR_CPU_KERNELS"
# Instruction-set levels every source must compile for (`cross_compile`): x86-64-v3 (AVX2 and
# FMA), AVX-512, AVX-512 BF16 and AMX.
TARGETS = ("haswell", "skylake-avx512", "cooperlake", "sapphirerapids")
RECORD = "groups.json"
# Where a build had to compile fewer sources at once (a killed compiler), how many.
JOBS_RECORD = "jobs"


# What the compiler says when the system killed it (out of memory, most often, on a small
# machine or container building several sources at once): not the sources' fault.
KILLED = re.compile(
    r"Killed signal terminated program|internal compiler error: Killed"
    r"|unable to execute command: Killed|failed due to signal"
)
KILLED_REASON = "the compiler was killed (out of memory?); the next start builds it again"


@dataclass(slots=True)
class BuildResult:
    """Which groups loaded, and why the others did not (group name -> reason); `lasting`: the
    failures are the sources' own and are recorded, so later starts do not compile them again
    (a killed compiler's are not)."""

    built: tuple[str, ...] = ()
    failed: dict[str, str] = field(default_factory=dict)
    lasting: bool = True


def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them (one core's line: all cores match),
    else the platform's processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def compiler() -> str | None:
    """The C++ compiler torch's builder runs (`$CXX`, else `c++`), where it is installed."""
    return shutil.which(os.environ.get("CXX", "c++"))


def why_unsupported() -> str:
    """Why this machine builds no kernels at all ("" where it can try): they are x86-64 code
    and need a C++ compiler."""
    if os.environ.get(SWITCH_VARIABLE, "").lower() in ("0", "off", "false", "no"):
        return f"{SWITCH_VARIABLE}={os.environ[SWITCH_VARIABLE]} turns them off"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"they are x86-64 code and this is {platform.machine() or 'an unknown machine'}"
    if compiler() is None:
        return "no C++ compiler was found (install g++, or set CXX)"
    return ""


def march() -> str:
    return os.environ.get(MARCH_VARIABLE) or "native"


def cflags() -> list[str]:
    return ["-O3", f"-march={march()}", "-fopenmp"]


@cache
def target_features() -> frozenset[str]:
    """The instruction-set macros the compiler defines for the build's `-march` (`AVX2`,
    `AVX512BF16`, `AMX_TILE`, ...): what the kernels are built to use."""
    cxx = compiler()
    if cxx is None:
        return frozenset()
    result = subprocess.run(
        [cxx, f"-march={march()}", "-dM", "-E", "-x", "c++", os.devnull],
        capture_output=True,
        text=True,
    )
    return frozenset(re.findall(r"^#define __([A-Z0-9_]+)__ 1$", result.stdout, re.MULTILINE))


def build_name() -> str:
    """Unique per sources, headers, flags, CPU features and torch version."""
    digest = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in SOURCES + HEADERS),
        " ".join(cflags()).encode(),
        cpu_flags().encode(),
        torch.__version__.encode(),
    ):
        digest.update(part)
    return f"conveyor_cpu_{digest.hexdigest()[:16]}"


def without(groups: tuple[str, ...], failed: set[str]) -> tuple[str, ...]:
    """`groups` less the failed ones and every group that needs one left out."""
    kept = [g for g in groups if g not in failed]
    needs = {group.name: group.needs for group in GROUPS}
    changed = True
    while changed:
        changed = False
        for name in list(kept):
            if any(need not in kept for need in needs[name]):
                kept.remove(name)
                changed = True
    return tuple(kept)


def build(root: Path, name: str | None = None) -> BuildResult:
    """Build and load every group that builds here, under `root / name`."""
    reason = why_unsupported()
    if reason:
        logger.warning("Conveyor's CPU kernels are not used: %s; serving on pure torch", reason)
        return BuildResult(failed={group.name: reason for group in GROUPS})
    name = name or build_name()
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    with build_lock(folder):
        _clear_stale_batons(folder)
        result = _build_groups(folder, name, _recorded_failures(folder))
        if result.lasting:
            (folder / RECORD).write_text(json.dumps(result.failed, indent=1))
    for group, why in result.failed.items():
        logger.warning(
            "Conveyor's CPU kernels: the %s group did not build (%s); its routes "
            "fall back to torch",
            group,
            why,
        )
    return result


def _build_groups(folder: Path, name: str, failed: dict[str, str]) -> BuildResult:
    groups = without(GROUP_NAMES, set(failed))
    jobs = _recorded_jobs(folder)  # None: the builder's default, a job per core and two more
    while groups:
        try:
            _compile(folder, name, groups, jobs)
            return BuildResult(groups, _left_out(groups, failed))
        except Exception as error:  # a compiler error, no ninja, an unloadable library
            message = str(error)
            if KILLED.search(message):
                if jobs is None:  # here and at later starts, one source at a time
                    logger.warning(
                        "the C++ compiler was killed (out of memory?); building "
                        "Conveyor's CPU kernels again one source at a time"
                    )
                    jobs = 1
                    (folder / JOBS_RECORD).write_text(f"{jobs}\n")
                    continue
                return BuildResult((), {g.name: KILLED_REASON for g in GROUPS}, lasting=False)
            broken = _failed_groups(message, groups)
            reason = _reason(message)
            if not broken:  # no one source explains it: nothing builds
                return BuildResult((), {g.name: reason for g in GROUPS})
            failed.update({group: reason for group in broken})
            groups = without(groups, set(failed))
    return BuildResult((), _left_out((), failed))


def _left_out(groups: tuple[str, ...], failed: dict[str, str]) -> dict[str, str]:
    """Each group not built, with its own failure or the group it needs that failed."""
    reasons = dict(failed)
    for group in GROUPS:
        if group.name not in groups and group.name not in reasons:
            missing = [need for need in group.needs if need not in groups]
            reasons[group.name] = f"it needs the {', '.join(missing)} group"
    return reasons


def _compile(folder: Path, name: str, groups: tuple[str, ...], jobs: int | None = None) -> None:
    """One extension of these groups' sources, loaded into torch.ops.conveyor; `jobs`: how many
    sources compile at once (None: the builder's default). A build of another number of jobs
    has a name of its own: torch's builder builds a name once a process, and only loads it
    again after a build that failed."""
    if jobs is None:
        _load_extension(folder, name, groups)
        return
    name = f"{name}_j{jobs}"
    before = os.environ.get("MAX_JOBS")
    os.environ["MAX_JOBS"] = str(jobs)  # read by torch's builder as it runs ninja
    try:
        _load_extension(folder, name, groups)
    finally:
        if before is None:
            del os.environ["MAX_JOBS"]
        else:
            os.environ["MAX_JOBS"] = before


def _load_extension(folder: Path, name: str, groups: tuple[str, ...]) -> None:
    """torch's builder run over the groups' sources, in a folder of their own where only some
    groups build."""
    from torch.utils.cpp_extension import load as load_extension

    if groups != GROUP_NAMES:
        tag = hashlib.sha256("+".join(groups).encode()).hexdigest()[:8]
        name, folder = f"{name}_{tag}", folder / "+".join(groups)
        folder.mkdir(exist_ok=True)
    sources = [str(CSRC / g.name / s) for g in GROUPS if g.name in groups for s in g.sources]
    load_extension(
        name,
        sources,
        extra_cflags=cflags(),
        extra_include_paths=[str(INCLUDE)],
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )


def _failed_groups(message: str, groups: tuple[str, ...]) -> set[str]:
    """The groups whose sources the builder's output names as failed (`FAILED: x.o`; ninja
    1.13 and later: `FAILED: [code=1] x.o`)."""
    objects = set(re.findall(r"FAILED: (?:\[code=-?\d+\] )?(?:\S*/)?([\w.]+)\.o\b", message))
    return {
        g.name
        for g in GROUPS
        if g.name in groups and any(Path(s).stem in objects for s in g.sources)
    }


def _reason(message: str) -> str:
    """The compiler's first error line, else the message's first line."""
    for line in message.splitlines():
        if "error:" in line:
            return line.strip().removeprefix(str(CSRC) + "/")
    return message.splitlines()[0] if message else "unknown error"


def _recorded_jobs(folder: Path) -> int | None:
    """How many sources the build in `folder` compiles at once, where an earlier start had to
    lower it (None: the builder's default)."""
    try:
        return max(1, int((folder / JOBS_RECORD).read_text()))
    except (OSError, ValueError):
        return None


def _recorded_failures(folder: Path) -> dict[str, str]:
    try:
        recorded = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(recorded, dict):
        return {}
    return {k: str(v) for k, v in recorded.items() if k in GROUP_NAMES}


def build_lock(folder: Path) -> AbstractContextManager[None]:
    """Hold the folder's build lock (`folder_lock.held`)."""
    doing = f"building Conveyor's CPU kernels in {folder}"
    return folder_lock.held(folder / "conveyor.lock", doing, logger)


def _clear_stale_batons(folder: Path) -> None:
    """torch's builder waits while its `lock` file exists; under `build_lock` no live build owns
    one, so a file there was left by a build whose process died."""
    for baton in folder.rglob("lock"):
        logger.warning(
            "removing %s, left by a build of Conveyor's CPU kernels that stopped "
            "before it finished; building again",
            baton,
        )
        baton.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class CompileFailure:
    target: str
    source: str
    errors: str


def cross_compile(
    targets: Sequence[str], workdir: Path, jobs: int | None = None, csrc: Path = CSRC
) -> list[CompileFailure]:
    """Compile every source for each `-march=<target>` (object code thrown away, no
    optimisation), whatever this host runs: a guard missing for a narrower instruction set
    fails here on any machine. The torch headers are parsed once per target, as a precompiled
    header, and a group's sources are compiled as one unit (loading that header once); a unit
    that fails is compiled again source by source, so that each failure names its source and
    two sources' private names alike never fail it. The targets' headers, then every (target,
    group) pair, share one pool of jobs. `csrc`: the sources' folder (a group a folder)."""
    groups: dict[str, list[Path]] = {}
    for source in sorted(csrc.glob("*/*.cpp")):
        groups.setdefault(source.parent.name, []).append(source)
    includes = _system_includes(csrc)
    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        made = pool.map(lambda target: _torch_header(target, workdir, includes), targets)
        headers = dict(zip(targets, made, strict=True))
        pairs = [(target, group) for target in targets for group in groups]
        results = pool.map(
            lambda pair: _compile_group(pair[0], groups[pair[1]], headers[pair[0]]), pairs
        )
        return [failure for failures in results for failure in failures]


def _compile_group(target: str, sources: list[Path], header: Path) -> list[CompileFailure]:
    unit = header.parent / f"{sources[0].parent.name}_unit.cpp"
    unit.write_text("".join(f'#include "{source}"\n' for source in sources))
    if _compile_for(target, unit, header) is None:
        return []
    failures = (_compile_for(target, source, header) for source in sources)
    return [failure for failure in failures if failure is not None]


def _torch_header(target: str, workdir: Path, includes: list[str]) -> Path:
    """The sources' system `includes`, precompiled for `target`."""
    header = workdir / target / "torch_headers.h"
    header.parent.mkdir(parents=True, exist_ok=True)
    header.write_text("".join(f"#include <{h}>\n" for h in includes))
    _run([*_cross_flags(target), "-x", "c++-header", str(header), "-o", f"{header}.gch"])
    return header


def _compile_for(target: str, source: Path, header: Path) -> CompileFailure | None:
    command = [*_cross_flags(target), "-include", str(header), "-c", str(source), "-o", os.devnull]
    result = _run(command, check=False)
    if result.returncode == 0:
        return None
    errors = "\n".join(line for line in result.stderr.splitlines() if "error" in line)
    return CompileFailure(target, source.name, errors or result.stderr[-2000:])


def _cross_flags(target: str) -> list[str]:
    """The flags torch's builder gives the real build (its C++ standard, ABI and includes), at
    another `-march` and without optimisation."""
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler() or "c++",
        "-std=c++20",
        "-fPIC",
        "-fopenmp",
        "-O0",
        f"-march={target}",
        "-w",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in [*includes, INCLUDE]),
    ]


def _system_includes(csrc: Path = CSRC) -> list[str]:
    """Every `#include <...>` of the sources and headers under `csrc`, for the precompiled
    header."""
    found: set[str] = set()
    for path in [*csrc.glob("*/*.cpp"), *csrc.glob("include/*.h")]:
        found.update(re.findall(r"^#include <([^>]+)>", path.read_text(), re.MULTILINE))
    return sorted(found)


def _run(command: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:8])} ... failed:\n{result.stderr[-2000:]}")
    return result
