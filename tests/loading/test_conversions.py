"""Conversions into the cache (`engine/loading/conversions.py`): two starts at once take turns."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from engine.loading.conversions import convert_once, finished


def test_two_starts_at_once_convert_once_and_both_get_the_folder(tmp_path: Path, caplog) -> None:
    target = tmp_path / "models" / "converted"
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def convert(staged: Path) -> dict[str, object]:
        calls.append(threading.current_thread().name)
        staged.mkdir(parents=True)
        (staged / "weights").write_text("w")
        started.set()
        assert release.wait(timeout=60)
        return {"source": "test"}

    results: dict[str, Path] = {}

    def start(name: str) -> None:
        results[name] = convert_once(target, "marker.json", convert)

    first = threading.Thread(target=start, args=("first",), name="first")
    second = threading.Thread(target=start, args=("second",), name="second")
    with caplog.at_level(logging.INFO, logger="engine.loading.conversions"):
        first.start()
        assert started.wait(timeout=60)
        second.start()
        for _ in range(6000):  # a bound, not a timing: the line comes before the wait
            if "waiting for process" in caplog.text:
                break
            threading.Event().wait(0.01)
        assert "waiting for process" in caplog.text and "converting converted" in caplog.text
        release.set()
        first.join(timeout=60)
        second.join(timeout=60)
    assert calls == ["first"]
    assert results == {"first": target, "second": target}
    assert finished(target, "marker.json") and (target / "weights").read_text() == "w"
    assert json.loads((target / "marker.json").read_text())["source"] == "test"
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".convert-")] == []


def test_an_unfinished_folder_is_converted_again_in_its_place(tmp_path: Path) -> None:
    target = tmp_path / "converted"
    target.mkdir()
    (target / "half-written").write_text("")

    def convert(staged: Path) -> dict[str, object]:
        staged.mkdir()
        (staged / "weights").write_text("w")
        return {}

    assert convert_once(target, "marker.json", convert) == target
    assert sorted(p.name for p in target.iterdir()) == ["marker.json", "weights"]
