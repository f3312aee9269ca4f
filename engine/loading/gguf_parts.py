"""A GGUF file split in parts, as llama.cpp's `gguf-split` writes a large one (and as hub
repositories hold them): `NAME-00001-of-00003.gguf` and its siblings in one folder, the first
holding the metadata (config, tokenizer) and some of the tensors, the others the rest. Such a
file is named by its first part; the others are found beside it."""

from __future__ import annotations

import re
from pathlib import Path

PART = re.compile(r"^(?P<stem>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def parts(path: Path) -> list[Path]:
    """The files of the GGUF file at `path`: itself, or every part of the split file whose
    first part it is. A later part, or a set with one missing, is refused by name."""
    match = PART.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if int(match["number"]) != 1:
        first = path.with_name(part_name(match["stem"], 1, count, path.suffix))
        raise ValueError(f"{path.name} is a later part of a split GGUF file: name {first.name}")
    found = [
        path.with_name(part_name(match["stem"], n, count, path.suffix)) for n in range(1, count + 1)
    ]
    missing = [file.name for file in found if not file.is_file()]
    if missing:
        raise ValueError(
            f"{path.name}: parts of the split GGUF file are missing: {', '.join(missing)}"
        )
    return found


def part_name(stem: str, number: int, count: int, suffix: str = ".gguf") -> str:
    return f"{stem}-{number:05d}-of-{count:05d}{suffix}"


def model_name(path: Path) -> str:
    """The model's name from its file: the name less `.gguf` and any part numbers."""
    match = PART.match(path.name)
    return match["stem"] if match is not None else path.stem


def first_of_one_set(paths: list[Path]) -> Path | None:
    """The first part, where `paths` are the parts of one split file and nothing else."""
    firsts = [
        path for path in paths if (match := PART.match(path.name)) and match["number"] == "00001"
    ]
    if len(firsts) != 1:
        return None
    try:
        return firsts[0] if sorted(parts(firsts[0])) == sorted(paths) else None
    except ValueError:  # a part missing
        return None
