"""A batch's status, as OpenAI documents it, and the next step a gateway should take for it.

    validating ─→ in_progress ─→ finalizing ─→ completed
        │  │           │  └──────────────────→ expired     (the completion window ran out)
        │  └→ failed   └──→ cancelling ─→ cancelled
        └───────────────────┘

``next_step`` is pure: it takes the record, how many lines have results and ``now_s``, and names
what to do; the coordinator (``shared.openai_api.batch.coordinator``) does it. A step is claimed first
(``claimed_at``) so two gateways do not run it at once; a claim older than ``claim_stale_s`` is
taken over (its gateway died mid-step: every step is idempotent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.protocol.batch import BatchRecord, BatchStatus

TERMINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
_ALLOWED: dict[str, frozenset[str]] = {
    "validating": frozenset({"in_progress", "failed", "cancelling"}),
    "in_progress": frozenset({"finalizing", "cancelling", "expired"}),
    "finalizing": frozenset({"completed", "expired"}),
    "cancelling": frozenset({"cancelled"}),
}
_STAMP = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
          "failed": "failed_at", "expired": "expired_at", "cancelling": "cancelling_at", "cancelled": "cancelled_at"}
WINDOWS_S = {"24h": 24 * 3600}


class InvalidTransition(ValueError):
    pass


def transition(record: BatchRecord, to: BatchStatus, now_s: float, **changes) -> BatchRecord:
    """``record`` moved to ``to`` with its timestamp set (and ``changes`` applied, the claim
    dropped); raises InvalidTransition for a move OpenAI's lifecycle does not have."""
    if to not in _ALLOWED.get(record.status, frozenset()):
        raise InvalidTransition(f"batch {record.id}: cannot go from {record.status} to {to}")
    return record.model_copy(update={"status": to, _STAMP[to]: int(now_s), "claimed_at": None, **changes})


def can_cancel(record: BatchRecord) -> bool:
    return "cancelling" in _ALLOWED.get(record.status, frozenset())


StepKind = Literal["validate", "finalize", "expire", "finish_cancel"]


@dataclass(frozen=True)
class Step:
    kind: StepKind
    reason: str


def next_step(record: BatchRecord, num_results: int, now_s: float, *, claim_stale_s: float,
              cancel_grace_s: float) -> Step | None:
    """What the batch needs now, or None (terminal, claimed by someone, or lines still running).
    ``cancel_grace_s``: how long after the cancel the lines already running may still finish (and
    keep their results) before the batch is closed."""
    if record.status in TERMINAL:
        return None
    if record.claimed_at is not None and now_s - record.claimed_at < claim_stale_s:
        return None
    total = record.request_counts.total
    match record.status:
        case "validating":
            return Step("validate", "new batch")
        case "in_progress" if now_s >= record.expires_at:
            return Step("expire", f"{num_results}/{total} lines done when the window ended")
        case "in_progress" if num_results >= total:
            return Step("finalize", f"all {total} lines have results")
        case "finalizing":
            return Step("finalize", "finalization left unfinished")
        case "cancelling" if now_s >= (record.cancelling_at or 0) + cancel_grace_s:
            return Step("finish_cancel", f"cancelled with {num_results}/{total} lines done")
    return None
