"""Checkpoints converted once into Conveyor's cache (a GGUF file, an AWQ or GPTQ checkpoint):
staged in a scratch folder beside the target, moved into place whole, and marked finished by a
file written last, so that a start stopped halfway converts again. Two starts at once (replicas
sharing one cache) take turns under a lock: one converts while the other waits for its folder.
Weights are written shard by shard as they are read, so a conversion holds at most one shard in
memory."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import folder_lock

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# The layout of converted folders (kept in the marker file): a folder of an older layout
# converts again, in place.
LAYOUT = 2
# fp32 bytes per converted weight file.
SHARD_BYTES = 1 << 30


def source_key(paths: Iterable[Path]) -> str:
    """A short key of where the files at `paths` are, their sizes and modification times: an
    edited or replaced file gets another key, so its conversion runs again."""
    parts = []
    for path in paths:
        stat = path.stat()
        parts.append(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}")
    return hashlib.sha256("\0\0".join(parts).encode()).hexdigest()[:16]


def convert_once(target: Path, marker: str, convert: Callable[[Path], dict[str, Any]]) -> Path:
    """`target`, a folder `convert(folder)` fills, converted on first use; `convert`'s answer is
    kept in the file `marker`, written last, which says the conversion finished."""
    if finished(target, marker):
        return target
    with one_at_a_time(target, "converting"):
        if finished(target, marker):  # another process converted it while this one waited
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as scratch:
            staged = Path(scratch) / "converted"
            record = convert(staged) | {"layout": LAYOUT}
            (staged / marker).write_text(json.dumps(record) + "\n")
            replace(target, staged)
    return target


def one_at_a_time(target: Path, doing: str) -> AbstractContextManager[None]:
    """The lock (`folder_lock.held`, beside `target`) under which one process at a time makes
    `target`: a second start of the same model waits for the first's folder instead of making
    its own."""
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.parent / f".{target.name}.lock"
    return folder_lock.held(lock, f"{doing} {target.name} in {target.parent}", logger)


def replace(target: Path, staged: Path) -> None:
    """Move the finished folder `staged` into place as `target` (an unfinished or older one
    there is removed first)."""
    shutil.rmtree(target, ignore_errors=True)
    staged.rename(target)


def finished(target: Path, marker: str) -> bool:
    """Whether `target` holds a finished conversion of the current layout."""
    try:
        record = json.loads((target / marker).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("layout") == LAYOUT


class ShardWriter:
    """Tensors written into a folder's safetensors files as they come: a shard is saved once it
    holds `shard_bytes`; one shard is named `STEM.safetensors` (`model.safetensors`), several
    are numbered, with an index. A tensor's `note` goes into its shard's metadata under its
    name."""

    def __init__(self, out: Path, shard_bytes: int = SHARD_BYTES, stem: str = "model") -> None:
        self.out = out
        self.shard_bytes = shard_bytes
        self.stem = stem
        self._shard: dict[str, torch.Tensor] = {}
        self._notes: dict[str, str] = {}
        self._held = 0
        self._files: list[list[str]] = []
        self._total = 0
        out.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor, note: str | None = None) -> None:
        if self._held >= self.shard_bytes:
            self._save()
        self._shard[name] = tensor.contiguous()
        if note is not None:
            self._notes[name] = note
        self._held += tensor.nbytes

    def close(self) -> None:
        """Save the last shard and name the files."""
        if not self._files or self._shard:
            self._save()
        if len(self._files) == 1:
            (self.out / "shard-1.safetensors").rename(self.out / f"{self.stem}.safetensors")
            return
        weight_map = {}
        count = len(self._files)
        for number, names in enumerate(self._files, 1):
            file = f"{self.stem}-{number:05d}-of-{count:05d}.safetensors"
            (self.out / f"shard-{number}.safetensors").rename(self.out / file)
            weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
        index_file = self.out / f"{self.stem}.safetensors.index.json"
        index_file.write_text(json.dumps(index, indent=2) + "\n")

    def _save(self) -> None:
        from safetensors.torch import save_file

        self._files.append(list(self._shard))
        file = self.out / f"shard-{len(self._files)}.safetensors"
        save_file(self._shard, str(file), metadata={"format": "pt", **self._notes})
        self._total += self._held
        self._shard, self._notes, self._held = {}, {}, 0
