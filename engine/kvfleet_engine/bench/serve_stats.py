"""`kvfleet bench serve` report: percentiles, the summary record and its printed form."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvfleet_engine.bench.serve_load import RequestResult


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default method); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    results: list[RequestResult],
    duration_s: float,
    percentiles: Sequence[float],
    slos_ms: dict[str, float],
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.num_prompt_tokens for r in ok)
    total_out = sum(r.num_output_tokens for r in ok)
    series_ms = {
        "ttft": [r.ttft_s * 1e3 for r in ok],
        "tpot": [t * 1e3 for r in ok if (t := r.tpot_s) is not None],
        "itl": [gap * 1e3 for r in ok for gap in r.itls_s],
        "e2el": [r.e2e_s * 1e3 for r in ok],
    }
    latency: dict[str, dict[str, float]] = {}
    for name, values in series_ms.items():
        stats = {"mean": sum(values) / len(values) if values else math.nan}
        stats.update({f"p{p:g}": percentile(values, p) for p in percentiles})
        latency[f"{name}_ms"] = stats

    def meets(r: RequestResult) -> bool:
        measured = {"ttft": r.ttft_s * 1e3, "e2el": r.e2e_s * 1e3}
        if r.tpot_s is not None:
            measured["tpot"] = r.tpot_s * 1e3
        return all(measured.get(k, 0.0) <= v for k, v in slos_ms.items())

    errors = Counter(r.error[:120] for r in results if not r.success)
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(errors),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s if duration_s else math.nan,
        "output_token_throughput": total_out / duration_s if duration_s else math.nan,
        "total_token_throughput": (total_in + total_out) / duration_s if duration_s else math.nan,
        "goodput_slos_ms": slos_ms,
        "request_goodput": (
            sum(1 for r in ok if meets(r)) / duration_s if slos_ms and duration_s else None
        ),
        **latency,
    }


def format_report(summary: dict[str, Any]) -> str:
    lines = [
        f"{'requests completed / failed':<34}{summary['completed']} / {summary['failed']}",
        f"{'duration (s)':<34}{summary['duration_s']:.2f}",
        f"{'input / output tokens':<34}{summary['total_input_tokens']} / "
        f"{summary['total_output_tokens']}",
        f"{'request throughput (req/s)':<34}{summary['request_throughput']:.2f}",
        f"{'output token throughput (tok/s)':<34}{summary['output_token_throughput']:.1f}",
        f"{'total token throughput (tok/s)':<34}{summary['total_token_throughput']:.1f}",
    ]
    if summary["request_goodput"] is not None:
        lines.append(f"{'request goodput (req/s)':<34}{summary['request_goodput']:.2f}")
    if summary.get("client_start_spread_ms") is not None:  # several client processes
        spread = summary["client_start_spread_ms"]
        lines.append(f"{'client processes started within':<34}{spread:.1f} ms")
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = summary[name]
        cells = "  ".join(f"{k} {v:.2f}" for k, v in stats.items())
        lines.append(f"{name:<34}{cells}")
    for error, count in summary["errors"].items():
        lines.append(f"error ×{count}: {error}")
    return "\n".join(lines)
