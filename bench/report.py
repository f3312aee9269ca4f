"""Summaries of a serving benchmark: throughput, latency percentiles, goodput under SLOs."""

from __future__ import annotations

import statistics
from typing import Any

from bench.client import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2el")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def parse_slo(items: list[str]) -> dict[str, float]:
    """`ttft:500 tpot:50 e2el:10000` (milliseconds) to seconds by key."""
    slo = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise ValueError(f"SLO must look like ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slo[key] = float(value) / 1000
    return slo


def meets(result: RequestResult, slo: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.e2e}
    return result.ok and all(measured[key] <= limit for key, limit in slo.items())


def _stats(name: str, values: list[float], percentiles: list[int]) -> dict[str, float]:
    values_ms = [v * 1000 for v in values]
    out = {f"mean_{name}_ms": statistics.fmean(values_ms) if values_ms else 0.0}
    for q in percentiles:
        out[f"p{q}_{name}_ms"] = percentile(values_ms, q)
    return out


def peak_output_throughput(results: list[RequestResult]) -> float:
    """The most output tokens of completed requests that arrived within one second of the run
    (whole seconds from its start), as `vllm bench serve` counts them. A piece is a token; tokens
    a stream held back and sent later (such as the bytes of one character) count with its last
    piece."""
    per_second: dict[int, int] = {}
    for result in results:
        times = result.token_times() if result.ok else []
        for i, at in enumerate(times):
            extra = max(0, result.output_len - len(times)) if i == len(times) - 1 else 0
            per_second[int(at)] = per_second.get(int(at), 0) + 1 + extra
    return float(max(per_second.values(), default=0))


def peak_concurrency(results: list[RequestResult]) -> int:
    """The most requests in flight at one moment (a request ending as another starts is not
    counted with it)."""
    spans = [r for r in results if r.e2e > 0]
    events = sorted([(r.start + r.e2e, -1) for r in spans] + [(r.start, 1) for r in spans])
    peak = running = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


def summarize(
    results: list[RequestResult], duration: float, percentiles: list[int], slo: dict[str, float]
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output = sum(r.output_len for r in done)
    prompt = sum(r.prompt_len for r in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (prompt + output) / duration if duration else 0.0,
        "peak_output_throughput": peak_output_throughput(results),
        "peak_concurrent_requests": peak_concurrency(results),
    }
    summary.update(_stats("ttft", [r.ttft for r in done], percentiles))
    summary.update(_stats("tpot", [r.tpot for r in done if r.tpot is not None], percentiles))
    summary.update(_stats("itl", [i for r in done for i in r.itls], percentiles))
    summary.update(_stats("e2el", [r.e2e for r in done], percentiles))
    if slo:
        good = sum(meets(r, slo) for r in results)
        summary["goodput"] = good / duration if duration else 0.0
        summary["slo"] = {key: value * 1000 for key, value in slo.items()}
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["errors"] = sorted(set(errors))[:5]
    return summary


def class_name(priority: int) -> str:
    return "high" if priority == 0 else "low" if priority == 1 else f"priority {priority}"


def overload(
    results: list[RequestResult], duration: float, percentiles: list[int]
) -> dict[str, Any]:
    """Who waited, who was turned away, who missed the deadline, per priority class."""
    waits = [r.ttft if r.output_len else r.e2e for r in results]
    on_time = [r for r in results if r.ok and not r.timed_out]
    classes = {}
    for priority in sorted({r.priority for r in results}):
        mine = [r for r in results if r.priority == priority]
        served = [r.ttft for r in mine if r.output_len]
        classes[class_name(priority)] = {
            "requests": len(mine),
            "completed_on_time": sum(r.ok and not r.timed_out for r in mine),
            "timed_out": sum(r.timed_out for r in mine),
            "rejected": sum(r.rejected for r in mine),
            **{f"p{q}_ttft_ms": percentile(served, q) * 1000 for q in percentiles},
        }
    return {
        "deadline_goodput": len(on_time) / duration if duration else 0.0,
        "rejected": sum(r.rejected for r in results),
        "timed_out": sum(r.timed_out for r in results),
        "longest_wait_s": max(waits, default=0.0),
        "by_class": classes,
    }


def table(summary: dict[str, Any]) -> str:
    """The summary as a fixed-width table, in the spirit of `vllm bench serve`."""
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    labels = {
        "completed": "Successful requests",
        "failed": "Failed requests",
        "duration_s": "Benchmark duration (s)",
        "total_input_tokens": "Total input tokens",
        "total_output_tokens": "Total generated tokens",
        "request_throughput": "Request throughput (req/s)",
        "output_throughput": "Output token throughput (tok/s)",
        "total_token_throughput": "Total token throughput (tok/s)",
        "peak_output_throughput": "Peak output token throughput (tok/s)",
        "peak_concurrent_requests": "Peak concurrent requests",
        "goodput": "Request goodput (req/s)",
    }
    for key, label in labels.items():
        if key in summary:
            value = summary[key]
            text = f"{value:.2f}" if isinstance(value, float) else str(value)
            lines.append(f"{label:<45}{text:>15}")
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for key, value in summary.items():
            if key.endswith(f"_{name}_ms"):
                label = key.replace(f"_{name}_ms", "").replace("mean", "Mean").replace("p", "P")
                lines.append(f"{label + ' ' + name.upper() + ' (ms)':<45}{value:>15.2f}")
    if "overload" in summary:
        lines.extend(_overload_lines(summary["overload"]))
    lines.append("=" * 60)
    return "\n".join(lines)


def _overload_lines(data: dict[str, Any]) -> list[str]:
    lines = [
        "{s:{c}^60}".format(s=" Overload ", c="-"),
        f"{'Goodput, on time (req/s)':<45}{data['deadline_goodput']:>15.2f}",
        f"{'Rejected (503)':<45}{data['rejected']:>15}",
        f"{'Timed out':<45}{data['timed_out']:>15}",
        f"{'Longest wait (s)':<45}{data['longest_wait_s']:>15.2f}",
    ]
    for name, row in data["by_class"].items():
        for key, value in row.items():
            text = f"{value:.2f}" if isinstance(value, float) else str(value)
            lines.append(f"{name + ' ' + key:<45}{text:>15}")
    return lines
