"""Sum up an engine step trace (a worker's ``--step-trace FILE``, ``shared/engine/step_trace.py``).

    python -m loadtest.tools.step_trace FILE [--from T --to T]

Steps are grouped by what they carried: ``decode`` (no prompt tokens) or ``prefill p<P>`` (prompt
tokens of priority P, the most urgent one if several; decode rows may ride along), or ``stopped``
(the part of a step that ran before its prefill stopped between two layers for a more urgent request
or for more urgent decode rows, a slice; the step that ends that prefill is a ``prefill`` step, and a
step of decode rows between two slices a ``decode`` step). For each group: how many steps, their mean
and median time, and their share of the wall-clock window, and for prefill steps the kind of the
step just before each (``after``: a premium prompt right after a batch prefill step waited for it);
and how busy the engine was (the steps' time over the window). ``--from``/``--to`` cut the window in the trace's
clock (``time.monotonic()`` on the host, which a bench on the same host can read too).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from shared.telemetry.measure import percentile


def read(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def kind(step: dict) -> str:
    if step.get("paused"):  # its prefill stopped between two layers for a more urgent request
        return "stopped"
    prompts = [row["priority"] for row in step["rows"] if row["prompt"]]
    return f"prefill p{min(prompts)}" if prompts else "decode"


def whole(steps: list[dict]) -> tuple[float, float]:
    """The trace's span: the first step's start to the last one's end."""
    return steps[0]["t"], steps[-1]["t"] + steps[-1]["s"]


def summarize(steps: list[dict], windows: list[tuple[float, float]] | None = None) -> dict:
    """The steps that started in the windows ([start, end) each; default: the whole trace) by kind;
    ``busy`` is their time over the windows' total."""
    if windows is None:
        windows = [whole(steps)] if steps else []
    picked = [i for i, s in enumerate(steps) if any(a <= s["t"] < b for a, b in windows)]
    if not picked:
        return {"steps": 0}
    sel = [steps[i] for i in picked]
    window = max(sum(b - a for a, b in windows), 1e-9)
    by_kind: dict[str, list[float]] = defaultdict(list)
    after: dict[str, Counter] = defaultdict(Counter)  # prefill kind -> kinds of the step just before
    decode_rows = []
    for i in picked:
        s = steps[i]
        by_kind[k := kind(s)].append(s["s"])
        if k == "decode":
            decode_rows.append(len(s["rows"]))
        elif k.startswith("prefill") and i > 0:
            after[k][kind(steps[i - 1])] += 1
    return {"steps": len(sel), "window_s": window, "busy": sum(s["s"] for s in sel) / window,
            "decode_rows_per_decode_step": statistics.mean(decode_rows) if decode_rows else None,
            "kinds": {k: {"steps": len(ts), "mean_ms": statistics.mean(ts) * 1000,
                          "p50_ms": percentile(ts, 50) * 1000, "time_share": sum(ts) / window}
                      | ({"after": dict(sorted(after[k].items()))} if k in after else {})
                      for k, ts in sorted(by_kind.items())}}


def format_summary(summary: dict) -> str:
    if not summary["steps"]:
        return "no steps in the window"
    lines = [f"{summary['steps']} steps over {summary['window_s']:.1f} s, engine busy {summary['busy']:.0%}"]
    for name, k in summary["kinds"].items():
        lines.append(f"  {name:<12} {k['steps']:6d} steps, mean {k['mean_ms']:6.1f} ms, p50 {k['p50_ms']:6.1f} ms, "
                     f"{k['time_share']:.0%} of the time")
        if "after" in k:
            lines.append("      right after: " + ", ".join(f"{n} {c}" for n, c in k["after"].items()))
    if summary["decode_rows_per_decode_step"] is not None:
        lines.append(f"  rows per decode step: {summary['decode_rows_per_decode_step']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--from", dest="t_from", type=float, default=None, help="window start (the trace's clock)")
    p.add_argument("--to", dest="t_to", type=float, default=None, help="window end (the trace's clock)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    steps = read(args.trace)
    windows = None
    if steps and (args.t_from is not None or args.t_to is not None):
        start, end = whole(steps)
        windows = [(start if args.t_from is None else args.t_from, end if args.t_to is None else args.t_to)]
    summary = summarize(steps, windows)
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
