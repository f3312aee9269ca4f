"""One small Markdown summary per results folder, for the docs to cite: raw benchmark output
(JSON per run, logs) stays out of git in `benchmarks/results/`, and what a published table rests
on is kept as `docs/results/<folder>.md`.

    python benchmarks/summarize_results.py benchmarks/results/side_by_side [--out docs/results]

Per run of `conveyor bench serve` (a JSON with `output_throughput`): completed requests, output
tok/s and the p50 TPOT and TTFT; per other JSON, its top-level numbers; per log, its last lines
(the alternating benchmarks print their medians there).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LOG_TAIL_LINES = 6
LINE_CHARS = 160


def serve_row(path: Path, run: dict) -> str:
    return (
        f"| `{path}` | {run.get('completed', '')} | {run['output_throughput']:.1f} | "
        f"{run.get('p50_tpot_ms', 0):.0f} | {run.get('p50_ttft_ms', 0) / 1000:.2f} |"
    )


def numbers(run: dict) -> str:
    pairs = [
        f"{k}={v:g}"
        for k, v in run.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    ]
    return ", ".join(pairs[:16]) or "(no top-level numbers)"


def log_tail(path: Path) -> list[str]:
    lines = [
        line.rstrip()[:LINE_CHARS]
        for line in path.read_text(errors="replace").splitlines()
        if line.strip()
    ]
    return lines[-LOG_TAIL_LINES:]


def summarize(folder: Path, root: Path) -> str:
    serve, other, logs = [], [], []
    # The root's own files only: each folder below it gets its own summary.
    paths = folder.glob("*") if folder.resolve() == root.resolve() else folder.rglob("*")
    for path in sorted(p for p in paths if p.is_file()):
        name = path.relative_to(root)
        if path.suffix == ".json":
            run = json.loads(path.read_text())
            if isinstance(run, dict) and "output_throughput" in run:
                serve.append(serve_row(name, run))
            elif isinstance(run, dict):
                other.append(f"- `{name}`: {numbers(run)}")
        elif path.suffix in (".log", ".txt"):
            logs.append(f"`{name}`:\n\n```\n" + "\n".join(log_tail(path)) + "\n```\n")
    parts = [f"# {folder.relative_to(root) if folder != root else 'results'}\n"]
    if serve:
        parts += [
            "| run | completed | output tok/s | TPOT p50 (ms) | TTFT p50 (s) |",
            "| --- | --- | --- | --- | --- |",
            *serve,
            "",
        ]
    if other:
        parts += [*other, ""]
    parts += logs
    return "\n".join(parts).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/results"))
    parser.add_argument("--root", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for folder in args.folders:
        name = "offline" if folder.resolve() == args.root.resolve() else folder.name
        target = args.out / f"{name}.md"
        target.write_text(summarize(folder, args.root))
        print(target)


if __name__ == "__main__":
    main()
