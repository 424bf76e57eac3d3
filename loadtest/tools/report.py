"""Results on disk: one JSON (config, summaries, per-request timings) and a latency-CDF PNG."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from loadtest.tools.stats import RequestResult
from shared.telemetry.plot import cdf, figure


def write_report(out_dir: Path, name: str, config: dict,
                 runs: dict[str, tuple[dict, list[RequestResult]]], extra: dict | None = None) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"{name}.json", out_dir / f"{name}.png"
    payload = {"config": config, **(extra or {}),
               "runs": {label: {"summary": s, "requests": [r.to_json() for r in rs]}
                        for label, (s, rs) in runs.items()}}
    json_path.write_text(json.dumps(payload, indent=2))
    with figure(png_path, 1, 3, figsize=(15, 4)) as (fig, axes):
        for label, (_, results) in runs.items():
            ok = [r for r in results if r.error is None]
            cdf(axes[0], [r.ttft_s * 1000 for r in ok if r.ttft_s is not None], label)
            cdf(axes[1], [x * 1000 for r in ok for x in r.itls_s()], label)
            cdf(axes[2], [r.e2e_s for r in ok if r.e2e_s is not None], label)
        for ax, title in zip(axes, ("TTFT (ms)", "inter-token latency (ms)", "end-to-end (s)")):
            ax.set_title(title)
            ax.set_ylabel("CDF")
            ax.grid(alpha=0.3)
            ax.legend()
    return json_path, png_path


def save_report(out_dir: Path, name: str, report: dict, plot: Callable[[Path, dict], None] | None = None,
                indent: int = 1) -> list[Path]:
    """A benchmark's ``report`` as ``out_dir``/``name``.json and, given ``plot(path, report)``, its
    figure as ``name``.png; prints and returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json"]
    paths[0].write_text(json.dumps(report, indent=indent))
    if plot is not None:
        paths.append(out_dir / f"{name}.png")
        plot(paths[1], report)
    print("wrote", *paths)
    return paths


def format_summary(label: str, s: dict) -> str:
    def ms(d: dict, k: str) -> str:
        return "-" if d.get(k) is None else f"{d[k] * 1000:.1f}"

    return (f"{label}: {s['num_ok']}/{s['num_requests']} ok, {s['request_throughput']:.2f} req/s, "
            f"{s['output_token_throughput']:.1f} tok/s, goodput {s['goodput']:.2f} req/s | "
            f"TTFT p50/p90/p99 {ms(s['ttft_s'], 'p50')}/{ms(s['ttft_s'], 'p90')}/{ms(s['ttft_s'], 'p99')} ms | "
            f"ITL p50/p90/p99 {ms(s['itl_s'], 'p50')}/{ms(s['itl_s'], 'p90')}/{ms(s['itl_s'], 'p99')} ms | "
            f"e2e p50/p99 {s['e2e_s']['p50'] or 0:.2f}/{s['e2e_s']['p99'] or 0:.2f} s")


def bar_chart(path: Path, groups: list[str], series: dict[str, list[float]], *, ylabel: str, title: str) -> None:
    """Grouped bars: one group per label in ``groups``, one bar per series in each."""
    with figure(path, figsize=(6, 4)) as (fig, ax):
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series.items()):
            ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(groups))], values, width, label=label)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
