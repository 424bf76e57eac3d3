"""The chaos run's bookkeeping, pure: each request's outcome classified against the fault-free
greedy reference, one ``FaultReport`` per fault, the printed table and the plot.

A request *succeeded* when it ended without an error (HTTP status other than 200, an error event in
the stream, a broken connection); it *hung* when it had not ended by its deadline. A succeeded
request whose text differs from the reference for its prompt is *differing* (a subset of the
succeeded): shorter than the reference is "lost" (tokens missing), longer is "repeated", the same
length "changed". Greedy decoding with ``ignore_eos`` makes the reference exact.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shared.telemetry.plot import figure


@dataclass
class RequestOutcome:
    """One request of the load: times in seconds from the start of its phase."""
    index: int
    prompt_index: int
    sent_s: float
    ended_s: float | None = None   # None: still running at its deadline (hung)
    error: str | None = None       # the error kind, e.g. "HTTP 503", "stream error", "connection"
    text: str = ""
    first_token_s: float | None = None  # when its first text arrived


@dataclass(frozen=True)
class FaultReport:
    fault: str
    skipped: str | None = None        # why the fault was not injected
    fault_at_s: float | None = None
    num_sent: int = 0
    num_succeeded: int = 0
    num_failed: int = 0
    failed_by_kind: dict[str, int] = field(default_factory=dict)
    num_hung: int = 0
    num_differing: int = 0
    differing_by_kind: dict[str, int] = field(default_factory=dict)
    next_success_s: float | None = None  # fault → the next end of any successful request
    recovery_s: float | None = None      # fault → end of the first success among requests sent after it
    # fault → the first token of a request sent at or after it that succeeded: serving again, as a
    # streaming client sees it (recovery_s adds that request's whole generation)
    serving_s: float | None = None
    e2e_p50_s: float | None = None       # the median successful request's duration, for scale
    leaked_blocks: dict[str, int] = field(default_factory=dict)  # worker id → blocks still used when idle
    restarts: dict[str, int] = field(default_factory=dict)       # process → restarts during the phase
    notes: list[str] = field(default_factory=list)

    @property
    def num_leaked_blocks(self) -> int:
        return sum(self.leaked_blocks.values())

    @property
    def is_clean(self) -> bool:
        """What the fault drill promises for a single fault: nothing failed, hung, differed or leaked."""
        return self.skipped is None and not (self.num_failed or self.num_hung or self.num_differing
                                             or self.num_leaked_blocks)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "num_leaked_blocks": self.num_leaked_blocks, "is_clean": self.is_clean}


def report_from_json(data: dict) -> FaultReport:
    """A FaultReport as ``to_json`` wrote it (derived fields dropped)."""
    return FaultReport(**{f.name: data[f.name] for f in dataclasses.fields(FaultReport) if f.name in data})


def difference(text: str, reference: str) -> str | None:
    """How ``text`` differs from the reference: None (it does not), "lost", "repeated" or "changed"."""
    if text == reference:
        return None
    if len(text) < len(reference):
        return "lost"
    return "repeated" if len(text) > len(reference) else "changed"


def classify(outcome: RequestOutcome, reference: dict[int, str]) -> str:
    """"hung", "failed", "differing" or "ok"."""
    if outcome.ended_s is None:
        return "hung"
    if outcome.error is not None:
        return "failed"
    return "ok" if difference(outcome.text, reference[outcome.prompt_index]) is None else "differing"


def recovery_s(outcomes: list[RequestOutcome], fault_at_s: float | None, *, sent_after: bool = True) -> float | None:
    """From the fault to the end of the first successful request sent at or after it (``sent_after``),
    or to the next end of any successful request."""
    if fault_at_s is None:
        return None
    ends = [o.ended_s for o in outcomes if o.ended_s is not None and o.error is None and o.ended_s >= fault_at_s
            and (o.sent_s >= fault_at_s or not sent_after)]
    return round(min(ends) - fault_at_s, 3) if ends else None


def serving_s(outcomes: list[RequestOutcome], fault_at_s: float | None) -> float | None:
    """From the fault to the earliest first token of a successful request sent at or after it."""
    if fault_at_s is None:
        return None
    firsts = [o.first_token_s for o in outcomes if o.ended_s is not None and o.error is None
              and o.first_token_s is not None and o.sent_s >= fault_at_s]
    return round(min(firsts) - fault_at_s, 3) if firsts else None


def fault_report(fault: str, outcomes: list[RequestOutcome], reference: dict[int, str], *,
                 fault_at_s: float | None, leaked_blocks: dict[str, int] | None = None,
                 restarts: dict[str, int] | None = None, notes: list[str] | None = None) -> FaultReport:
    kinds = Counter(classify(o, reference) for o in outcomes)
    failed = Counter(o.error for o in outcomes if o.ended_s is not None and o.error is not None)
    differing = Counter(difference(o.text, reference[o.prompt_index]) for o in outcomes
                        if classify(o, reference) == "differing")
    return FaultReport(
        fault=fault, fault_at_s=fault_at_s, num_sent=len(outcomes),
        num_succeeded=kinds["ok"] + kinds["differing"], num_failed=kinds["failed"],
        failed_by_kind=dict(failed), num_hung=kinds["hung"], num_differing=kinds["differing"],
        differing_by_kind=dict(differing), recovery_s=recovery_s(outcomes, fault_at_s),
        next_success_s=recovery_s(outcomes, fault_at_s, sent_after=False),
        serving_s=serving_s(outcomes, fault_at_s), e2e_p50_s=_median(
            [o.ended_s - o.sent_s for o in outcomes if o.ended_s is not None and o.error is None]),
        leaked_blocks={w: n for w, n in (leaked_blocks or {}).items() if n},
        restarts={p: n for p, n in (restarts or {}).items() if n}, notes=list(notes or []))


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def skipped_report(fault: str, reason: str) -> FaultReport:
    return FaultReport(fault=fault, skipped=reason)


def format_table(reports: list[FaultReport]) -> str:
    header = (f"{'fault':<16} {'sent':>5} {'ok':>5} {'failed':>6} {'hung':>5} {'differ':>6} "
              f"{'next s':>7} {'serve s':>7} {'recov s':>8} {'e2e p50':>7} {'leaked':>6}  "
              "restarts / failures / notes")
    lines = [header]
    for r in reports:
        if r.skipped:
            lines.append(f"{r.fault:<16} skipped: {r.skipped}")
            continue
        recov = "-" if r.recovery_s is None else f"{r.recovery_s:.2f}"
        next_s = "-" if r.next_success_s is None else f"{r.next_success_s:.2f}"
        e2e = "-" if r.e2e_p50_s is None else f"{r.e2e_p50_s:.2f}"
        serve = "-" if r.serving_s is None else f"{r.serving_s:.2f}"
        extra = [", ".join(f"{p} x{n}" for p, n in r.restarts.items()),
                 ", ".join(f"{k}: {n}" for k, n in r.failed_by_kind.items()),
                 ", ".join(f"{k}: {n}" for k, n in r.differing_by_kind.items()), *r.notes]
        lines.append(f"{r.fault:<16} {r.num_sent:>5} {r.num_succeeded:>5} {r.num_failed:>6} {r.num_hung:>5} "
                     f"{r.num_differing:>6} {next_s:>7} {serve:>7} {recov:>8} {e2e:>7} {r.num_leaked_blocks:>6}  "
                     + "; ".join(e for e in extra if e))
    return "\n".join(lines)


def totals(reports: list[FaultReport]) -> dict:
    """Across the injected faults: counts, the success ratio and how many faults were clean."""
    run = [r for r in reports if r.skipped is None]
    sent = sum(r.num_sent for r in run)
    return {"num_faults": len(run), "num_skipped": len(reports) - len(run),
            "num_clean": sum(r.is_clean for r in run), "num_sent": sent,
            "num_succeeded": sum(r.num_succeeded for r in run), "num_failed": sum(r.num_failed for r in run),
            "num_hung": sum(r.num_hung for r in run), "num_differing": sum(r.num_differing for r in run),
            "num_leaked_blocks": sum(r.num_leaked_blocks for r in run),
            "success_ratio": round(sum(r.num_succeeded for r in run) / sent, 4) if sent else None}


def format_totals(t: dict) -> str:
    ratio = "-" if t["success_ratio"] is None else f"{t['success_ratio']:.2%}"
    return (f"{t['num_clean']}/{t['num_faults']} faults clean ({t['num_skipped']} skipped); "
            f"{t['num_succeeded']}/{t['num_sent']} requests succeeded ({ratio}), {t['num_failed']} failed, "
            f"{t['num_hung']} hung, {t['num_differing']} differing, {t['num_leaked_blocks']} blocks leaked")


def plot(reports: list[FaultReport], path: Path) -> Path:
    """Per fault: failed / hung / differing requests and leaked blocks (bars), and the times from the
fault to the next success, to the first token and to the end of the first success of a request
sent after it."""

    run = [r for r in reports if r.skipped is None]
    names = [r.fault for r in run]
    xs = range(len(run))
    with figure(path, 1, 2, figsize=(14, 4.5)) as (fig, (bad, recov)):
        series = {"failed": [r.num_failed for r in run], "hung": [r.num_hung for r in run],
                  "differing": [r.num_differing for r in run], "leaked blocks": [r.num_leaked_blocks for r in run]}
        width = 0.2
        for i, (label, values) in enumerate(series.items()):
            bars = bad.bar([x + (i - 1.5) * width for x in xs], values, width, label=label)
            bad.bar_label(bars, fontsize=7)  # a 0 shows as "0", not as nothing
        bad.set_ylim(0, max([1, *(v for values in series.values() for v in values)]) * 1.2)
        bad.set_title("requests failed / hung / differing, blocks leaked (target: 0)")
        w = 0.21
        recov.bar([x - 1.5 * w for x in xs], [r.next_success_s or 0.0 for r in run], w, label="next success")
        recov.bar([x - 0.5 * w for x in xs], [r.serving_s or 0.0 for r in run], w,
                  label="first token of a request sent after the fault")
        recov.bar([x + 0.5 * w for x in xs], [r.recovery_s or 0.0 for r in run], w,
                  label="end of that request (first success sent after the fault)")
        recov.bar([x + 1.5 * w for x in xs], [r.e2e_p50_s or 0.0 for r in run], w, color="tab:gray",
                  label="median request duration (for scale)")
        recov.set_title("seconds from the fault (no bar: no such success in the phase)")
        recov.legend()
        for ax in (bad, recov):
            ax.set_xticks(list(xs), names, rotation=30, ha="right")
            ax.grid(alpha=0.3, axis="y")
        bad.legend()
    return path
