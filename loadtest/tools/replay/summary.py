"""A replay's outcomes and their summary, one form for live and simulated runs: counts, goodput
and attainment by tier (``shared.telemetry.measure``'s rule), latency distributions, hit ratios;
the JSON and PNG written out, and the simulator-against-live comparison."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loadtest.tools.replay.trace import ReplayRequest, TierSpec, ideal_ratios
from loadtest.tools.stats import RequestResult
from shared.telemetry.measure import distribution, meets_slo, percentile
from shared.telemetry.plot import cdf, figure


@dataclass
class Outcome:
    index: int
    tier: str
    status: str                       # "ok", "rejected" (429) or "failed"
    scheduled_s: float
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    finished_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    retry_after_s: float | None = None
    num_retries: int = 0
    predicted_ttft_s: float | None = None
    error: str | None = None
    worker: str | None = None         # live: the decode worker admission chose (X-Tandem-Worker)
    error_message: str | None = None  # live: the error body's message (a 429's reason)


def outcome_of(req: ReplayRequest, r: RequestResult) -> Outcome:
    ok = r.error is None and r.finished_s is not None
    status = "ok" if ok else ("rejected" if r.error == "HTTP 429" else "failed")
    return Outcome(req.index, req.tier, status, r.scheduled_s, r.ttft_s if ok else None, r.tpot_s if ok else None,
                   r.e2e_s if ok else None, r.finished_s, r.itls_s() if ok else [], r.prompt_tokens,
                   r.cached_tokens, r.num_output_tokens, r.retry_after_s, r.num_retries, r.predicted_ttft_s,
                   r.error, r.worker_id, r.error_message)


def _good(o: Outcome, t: TierSpec) -> bool:
    """Served within its tier's SLOs (``shared.telemetry.measure.meets_slo``): what goodput and
    attainment count."""
    return o.status == "ok" and meets_slo(o.ttft_s, o.tpot_s, t.ttft_slo_s, t.tpot_slo_s)


def _itls(outcomes: list[Outcome], itl_is_tpot: bool) -> list[float]:
    if itl_is_tpot:
        return [o.tpot_s for o in outcomes if o.tpot_s is not None and o.output_tokens > 1]
    return [x for o in outcomes for x in o.itls_s]


def _hits(ok: list[Outcome], requests: list[ReplayRequest]) -> dict:
    """The achieved prompt-token hit ratio against the ideal, and whether the prompts had the planned lengths."""
    with_usage = [o for o in ok if o.prompt_tokens]
    prompt = sum(o.prompt_tokens for o in with_usage)
    cached = sum(o.cached_tokens or 0 for o in with_usage)
    expected = {r.index: r.input_tokens for r in requests}
    ideal = ideal_ratios(requests)
    hit_ratio = cached / prompt if prompt else None
    return {
        "hit_ratio": hit_ratio, **ideal,
        "hit_ratio_vs_ideal": hit_ratio / ideal["ideal_token_hit_ratio"]
        if hit_ratio is not None and ideal["ideal_token_hit_ratio"] else None,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "prompt_tokens_mismatched": sum(1 for o in with_usage if o.prompt_tokens != expected.get(o.index)),
    }


def _tier_summary(t: TierSpec, outcomes: list[Outcome], duration: float, itl_is_tpot: bool) -> dict:
    mine = [o for o in outcomes if o.tier == t.name]
    mine_ok = [o for o in mine if o.status == "ok"]
    mine_good = [o for o in mine_ok if _good(o, t)]
    predicted = [o.ttft_s / o.predicted_ttft_s for o in mine_ok if o.ttft_s is not None and o.predicted_ttft_s]
    return {
        "requests": len(mine), "completed": len(mine_ok),
        "rejected": sum(1 for o in mine if o.status == "rejected"),
        "failed": sum(1 for o in mine if o.status == "failed"),
        "slo_ttft_s": t.ttft_slo_s, "slo_tpot_s": t.tpot_slo_s,
        "attainment": len(mine_good) / len(mine) if mine else None,
        "attainment_admitted": len(mine_good) / len(mine_ok) if mine_ok else None,
        "goodput_rps": len(mine_good) / duration,
        "ttft_s": distribution([o.ttft_s for o in mine_ok if o.ttft_s is not None]),
        "itl_s": distribution(_itls(mine_ok, itl_is_tpot)),
        "ttft_over_predicted_p50": percentile(predicted, 50),
    }


def summarize(outcomes: list[Outcome], requests: list[ReplayRequest], tiers: list[TierSpec],
              itl_is_tpot: bool = False) -> dict:
    """``itl_is_tpot``: the outcomes have no inter-token times (simulated): ITL percentiles are
    those of the requests' TPOT."""
    by_tier = {t.name: t for t in tiers}
    ok = [o for o in outcomes if o.status == "ok"]
    start = min((o.scheduled_s for o in outcomes), default=0.0)
    end = max((o.finished_s for o in ok if o.finished_s is not None), default=start)
    duration = max(end - start, 1e-9)
    good = [o for o in ok if _good(o, by_tier[o.tier])]
    retry_after = [o.retry_after_s for o in outcomes if o.retry_after_s is not None]
    return {
        "requests": len(outcomes), "completed": len(ok),
        "rejected": sum(1 for o in outcomes if o.status == "rejected"),
        "failed": sum(1 for o in outcomes if o.status == "failed"),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "retried": sum(o.num_retries for o in outcomes),
        "retry_after_s": {"mean": sum(retry_after) / len(retry_after), "max": max(retry_after)} if retry_after else None,
        **_hits(ok, requests),
        "duration_s": duration,
        "throughput_rps": len(ok) / duration,
        "output_tokens_per_s": sum(o.output_tokens for o in ok) / duration,
        "goodput_rps": len(good) / duration,
        "attainment": len(good) / len(outcomes) if outcomes else None,
        "ttft_s": distribution([o.ttft_s for o in ok if o.ttft_s is not None]),
        "itl_s": distribution(_itls(ok, itl_is_tpot)), "itl_is_tpot": itl_is_tpot,
        "tpot_s": distribution([o.tpot_s for o in ok if o.tpot_s is not None]),
        "e2e_s": distribution([o.e2e_s for o in ok if o.e2e_s is not None]),
        "tiers": {t.name: _tier_summary(t, outcomes, duration, itl_is_tpot) for t in tiers},
    }


def format_summary(label: str, s: dict) -> str:
    def ms(d: dict, k: str) -> str:
        return "-" if d.get(k) is None else f"{d[k] * 1000:.0f}"

    def pct(x) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    lines = [f"{label}: {s['completed']}/{s['requests']} completed, {s['rejected']} rejected (429), "
             f"{s['failed']} failed; {s['throughput_rps']:.2f} req/s, goodput {s['goodput_rps']:.2f} req/s "
             f"over {s['duration_s']:.1f} s",
             f"  TTFT p50/p90/p99 {ms(s['ttft_s'], 'p50')}/{ms(s['ttft_s'], 'p90')}/{ms(s['ttft_s'], 'p99')} ms, "
             f"ITL p50/p90/p99 {ms(s['itl_s'], 'p50')}/{ms(s['itl_s'], 'p90')}/{ms(s['itl_s'], 'p99')} ms",
             f"  prefix hit ratio {pct(s['hit_ratio'])} (ideal: {pct(s['ideal_token_hit_ratio'])} of tokens, "
             f"{pct(s['ideal_hit_ratio'])} of blocks; achieved/ideal {pct(s['hit_ratio_vs_ideal'])})"]
    for name, t in s["tiers"].items():
        lines.append(f"  {name}: {t['completed']}/{t['requests']} completed, {t['rejected']} rejected, "
                     f"TTFT p50/p90 {ms(t['ttft_s'], 'p50')}/{ms(t['ttft_s'], 'p90')} ms, attainment "
                     f"{pct(t['attainment'])} (admitted: {pct(t['attainment_admitted'])}, "
                     f"SLO {t['slo_ttft_s'] * 1000:.0f} ms)")
    return "\n".join(lines)


# --- report ------------------------------------------------------------------------------------

def plot(path: Path, outcomes: list[Outcome], summary: dict, title: str) -> None:
    with figure(path, 1, 4, figsize=(20, 4)) as (fig, axes):
        for tier in summary["tiers"]:
            ok = [o for o in outcomes if o.tier == tier and o.status == "ok"]
            cdf(axes[0], [o.ttft_s * 1000 for o in ok if o.ttft_s is not None], tier)
            cdf(axes[1], [x * 1000 for o in ok for x in o.itls_s] if not summary.get("itl_is_tpot")
                else [o.tpot_s * 1000 for o in ok if o.tpot_s is not None and o.output_tokens > 1], tier)
            axes[2].scatter([o.scheduled_s for o in ok], [o.ttft_s for o in ok], s=4, label=tier)
        rej = [o for o in outcomes if o.status == "rejected"]
        if rej:
            axes[2].scatter([o.scheduled_s for o in rej], [0.0] * len(rej), marker="x", s=8, color="red",
                            label="rejected (429)")
        bars = {"achieved (tokens)": summary["hit_ratio"] or 0.0, "ideal (tokens)": summary["ideal_token_hit_ratio"],
                "ideal (blocks)": summary["ideal_hit_ratio"]}
        axes[3].bar(list(bars), [100 * v for v in bars.values()], color=["tab:blue", "tab:grey", "tab:grey"])
        for ax, t, xl in zip(axes, ("TTFT (ms)", "inter-token latency (ms)", "TTFT (s) by send time",
                                    "prefix-cache hit ratio (%)"), ("ms", "ms", "sent at (s)", "")):
            ax.set_title(t)
            ax.set_xlabel(xl)
            ax.grid(alpha=0.3)
        for ax in axes[:3]:
            ax.legend(fontsize=7)
        axes[0].set_ylabel("CDF")
        fig.suptitle(title, fontsize=10)


def write_out(path: Path, summary: dict, config: dict, outcomes: list[Outcome], title: str,
              extra: dict | None = None, per_request: bool = True) -> tuple[Path, Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**summary, **(extra or {}), "config": config}
    if per_request:
        payload["per_request"] = [asdict(o) for o in outcomes]
    path.write_text(json.dumps(payload, indent=1, default=str))
    png = path.with_suffix(".png")
    plot(png, outcomes, summary, title)
    return path, png


def relative_error(sim: float | None, live: float | None) -> float | None:
    if sim is None or live is None or live == 0:
        return None
    return (sim - live) / live


def format_sim_vs_live(rows: dict) -> str:
    """``compare``'s rows on one line."""
    return "sim vs live: " + "; ".join(
        f"{k} {'-' if r['rel_error'] is None else format(r['rel_error'], '+.0%')}" for k, r in rows.items())


def compare(sim: dict, live: dict) -> dict:
    """The simulator against the live run: goodput, hit ratio, each tier's attainment, TTFT p50/p90."""
    rows = {"goodput_rps": (sim["goodput_rps"], live["goodput_rps"]),
            "hit_ratio": (sim["hit_ratio"], live["hit_ratio"]),
            "ttft_p50_s": (sim["ttft_s"]["p50"], live["ttft_s"]["p50"]),
            "ttft_p90_s": (sim["ttft_s"]["p90"], live["ttft_s"]["p90"])}
    for tier in live["tiers"]:
        rows[f"{tier}_attainment"] = (sim["tiers"][tier]["attainment"], live["tiers"][tier]["attainment"])
    return {k: {"sim": s, "live": v, "rel_error": relative_error(s, v)} for k, (s, v) in rows.items()}
