"""How much could any prefill/decode split policy gain on a replay? A hindsight bound.

    python -m loadtest.tools.split_oracle --fixed run-1p.json run-2p.json run-3p.json run-4p.json \
        [--policy autoscale.json] [--window-s 60,300,900] [--out oracle.json]

Each ``--fixed`` file is a ``loadtest.tools.replay`` summary with per-request results (no
``--no-per-request``) of the same trace and tiers under one fixed split (``--prefill-workers N``).
The arrivals are cut into windows of ``--window-s``. In each window the estimate takes the split
whose run served the most requests arriving in that window within their SLOs (TTFT of their tier,
and TPOT where the tier has one, as replay's goodput counts them). The sum over the windows, against
the best fixed split's total, estimates what a policy choosing a split per window with hindsight and
flipping for free could reach. It is an estimate, not a strict bound: a run's windows carry each
other's queues and caches, and a real switch pays for its flips and drains. ``--policy`` files (the
autoscaler's run) are reported against the same baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from shared.telemetry.measure import meets_slo


def good_by_window(summary: dict, window_s: float) -> Counter:
    """Requests that met their tier's SLOs, counted by the window of their arrival."""
    slo = {name: (t["slo_ttft_s"], t.get("slo_tpot_s")) for name, t in summary["tiers"].items()}
    return Counter(int(r["scheduled_s"] // window_s) for r in summary.get("per_request") or []
                   if r["status"] == "ok" and meets_slo(r["ttft_s"], r["tpot_s"], *slo[r["tier"]]))


def oracle(fixed: dict[str, dict], policies: dict[str, dict], window_s: float) -> dict:
    per = {name: good_by_window(s, window_s) for name, s in fixed.items()}
    totals = {name: sum(c.values()) for name, c in per.items()}
    best = max(totals, key=totals.get)
    windows = sorted(set().union(*per.values()))
    picks = [max(per, key=lambda name: (per[name][w], name == best)) for w in windows]
    hindsight = sum(per[name][w] for name, w in zip(picks, windows))
    return {
        "window_s": window_s, "num_windows": len(windows), "good_requests": totals,
        "best_fixed": best, "hindsight_good_requests": hindsight,
        "hindsight_over_best_fixed": hindsight / totals[best] if totals[best] else None,
        "splits_picked": dict(Counter(picks)),
        "policies": {name: {"good_requests": (n := sum(good_by_window(s, window_s).values())),
                            "over_best_fixed": n / totals[best] if totals[best] else None}
                     for name, s in policies.items()},
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.tools.split_oracle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fixed", nargs="+", required=True, help="replay summaries, one per fixed split")
    p.add_argument("--policy", nargs="*", default=[], help="replay summaries of policies to compare (autoscaler)")
    p.add_argument("--window-s", default="60,300,900", help="comma-separated window lengths (default: 60,300,900)")
    p.add_argument("--out", default=None, help="write the estimates as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        windows = [float(w) for w in args.window_s.split(",")]
        if any(w <= 0 for w in windows):
            raise ValueError
    except ValueError:
        print(f"error: --window-s must be positive numbers, got {args.window_s!r}", file=sys.stderr)
        return 2
    load = {}
    for path in [*args.fixed, *args.policy]:
        summary = json.loads(Path(path).read_text())
        if not summary.get("per_request"):
            print(f"error: {path} has no per-request results (rerun replay without --no-per-request)",
                  file=sys.stderr)
            return 2
        load[path] = summary
    fixed = {Path(p).stem: load[p] for p in args.fixed}
    policies = {Path(p).stem: load[p] for p in args.policy}
    results = [oracle(fixed, policies, w) for w in windows]
    for r in results:
        line = (f"windows of {r['window_s']:.0f} s ({r['num_windows']}): best fixed {r['best_fixed']} "
                f"{r['good_requests'][r['best_fixed']]} good requests; hindsight per window "
                f"{r['hindsight_good_requests']} ({r['hindsight_over_best_fixed']:.3f}x), picking {r['splits_picked']}")
        for name, p in r["policies"].items():
            line += f"; {name} {p['good_requests']} ({p['over_best_fixed']:.3f}x)"
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
