"""What a simulation run reports: goodput, SLO attainment, TTFT/TPOT percentiles, utilisation, cost."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from shared.planner.config import Slo
from shared.sim.simulator import SimResult
from shared.telemetry.measure import meets_slo_array, percentiles
from shared.telemetry.plot import figure


def summarize(r: SimResult, slo: Slo) -> dict:
    n = len(r.arrival_s)
    served = ~r.rejected & ~np.isnan(r.finish_s)
    good = served & meets_slo_array(r.ttft_s, r.tpot_s, slo.ttft_s, slo.tpot_s)
    start = float(r.arrival_s[0]) if n else 0.0
    end = float(np.nanmax(r.finish_s)) if served.any() else start
    duration = max(end - start, 1e-9)
    out_tokens = float(r.output_len[served].sum())
    cost = r.price_per_hour * duration / 3600
    return {
        "num_requests": n,
        "num_served": int(served.sum()),
        "num_rejected": int(r.rejected.sum()),
        "duration_s": duration,
        "throughput_rps": float(served.sum()) / duration,
        "goodput_rps": float(good.sum()) / duration,
        "slo_attainment": float(good.sum()) / max(n, 1),
        "ttft_s": percentiles(r.ttft_s[served], empty=math.nan),
        "tpot_s": percentiles(r.tpot_s[served & (r.output_len > 1)], empty=math.nan),
        "remote_prefill_fraction": float(r.remote_prefill[served].mean()) if served.any() else 0.0,
        "prefix_hit_tokens": int(r.cached_tokens[served].sum()),
        "mean_prefill_util": float(np.mean(r.prefill_util)) if r.prefill_util else 0.0,
        "mean_decode_kv_util": float(np.mean(r.decode_kv_util)) if r.decode_kv_util else 0.0,
        "role_flips": r.flips,
        "rejections": dict(r.rejections),
        "by_tier": {str(t): {"num_requests": int((r.tier == t).sum()),
                             "rejected_fraction": float(r.rejected[r.tier == t].mean()),
                             "slo_attainment": float(good[r.tier == t].mean())}
                    for t in sorted(set(r.tier.tolist()))},
        "cost_usd": cost,
        "cost_per_million_output_tokens": cost / out_tokens * 1e6 if out_tokens else float("inf"),
        "num_events": r.num_events,
    }


def format_summary(s: dict) -> str:
    t, p = s["ttft_s"], s["tpot_s"]
    return "\n".join([
        f"requests {s['num_requests']:,}: served {s['num_served']:,}, rejected {s['num_rejected']:,} "
        f"over {s['duration_s']:.1f} s simulated",
        f"throughput {s['throughput_rps']:.2f} req/s, goodput {s['goodput_rps']:.2f} req/s, "
        f"SLO attainment {s['slo_attainment'] * 100:.1f}%",
        f"TTFT p50/p90/p99 {t['p50'] * 1e3:.0f}/{t['p90'] * 1e3:.0f}/{t['p99'] * 1e3:.0f} ms; "
        f"TPOT p50/p90/p99 {p['p50'] * 1e3:.1f}/{p['p90'] * 1e3:.1f}/{p['p99'] * 1e3:.1f} ms",
        f"remote prefill {s['remote_prefill_fraction'] * 100:.0f}%, prefix-hit tokens {s['prefix_hit_tokens']:,}, "
        f"utilisation prefill {s['mean_prefill_util'] * 100:.0f}% / decode KV {s['mean_decode_kv_util'] * 100:.0f}%, "
        f"role flips {s['role_flips']}",
        f"cost ${s['cost_usd']:.2f} (${s['cost_per_million_output_tokens']:.3f} per 1M output tokens)",
    ] + ([", ".join(f"{t}: {v['rejected_fraction'] * 100:.0f}% rejected, {v['slo_attainment'] * 100:.0f}% in SLO"
                    for t, v in s["by_tier"].items())] if len(s["by_tier"]) > 1 else []))


def plot_utilisation(r: SimResult, path: str | Path, title: str = "") -> None:
    with figure(path, figsize=(8, 4), dpi=110) as (fig, ax):
        t = np.array(r.tick_s) - (r.tick_s[0] if r.tick_s else 0.0)
        ax.plot(t, np.array(r.prefill_util) * 100, label="prefill pool: busy %")
        ax.plot(t, np.array(r.decode_kv_util) * 100, label="decode pool: KV in use %")
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("utilisation (%)")
        ax.set_ylim(0, 105)
        if any(a != r.num_prefill[0] for a in r.num_prefill):
            ax2 = ax.twinx()
            ax2.step(t, r.num_prefill, color="grey", where="post", label="prefill workers")
            ax2.set_ylabel("prefill workers")
        ax.legend(loc="lower right")
        ax.set_title(title or "pool utilisation over time")
