"""The cluster as admission and the autoscaler see it: registry entries plus the latest load report
of each worker, plus what was admitted since that report (so a burst between two ~1 Hz reports
does not all land on the same worker). Pure: callers pass ``now`` and the observations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.cluster.workers import is_ready_worker
from shared.policy.kv_routing import WorkerLoadView
from shared.protocol.workers import ClusterStatusResult, Role, WorkerInfo, WorkerLoad, WorkerStatus


MAX_UNREPORTED_AGE_S = 5.0  # decode workers report about once a second and after each request


@dataclass
class _Admitted:
    at: float
    num_blocks: int
    priority: int | None = None  # None: not known, counted ahead of every priority


@dataclass
class WorkerEntry:
    info: WorkerInfo
    load: WorkerLoad | None = None
    load_received_at: float | None = None
    admitted: list[_Admitted] = field(default_factory=list)

    def load_view(self, now: float) -> WorkerLoadView:
        # A worker that reports rarely (or never) must not accumulate admissions forever.
        self.admitted = [a for a in self.admitted if now - a.at <= MAX_UNREPORTED_AGE_S]
        used = self.load.num_blocks_used if self.load else 0
        waiting = self.load.num_waiting if self.load else 0
        return WorkerLoadView(self.info.worker_id,
                              num_active_blocks=used + sum(a.num_blocks for a in self.admitted),
                              num_waiting=waiting, num_admitted_unreported=len(self.admitted))


    def prefill_tokens_ahead(self, priority: int, block_size: int, now: float) -> int:
        """Tokens a new request of ``priority`` would wait behind: those the worker reported at its
        priority or higher, plus those admitted to it since at its priority or higher (the engine
        schedules a lower priority after it: counting those too made a burst of batch admissions
        look like a premium backlog, and premium requests were rejected for it)."""
        reported = self.load.prefill_tokens_ahead(priority) if self.load else 0
        return reported + block_size * sum(a.num_blocks for a in self._admitted_ahead(priority, now))

    def num_admitted_ahead(self, priority: int, now: float) -> int:
        """Requests admitted to the worker since its last report at ``priority`` or higher: with
        a full batch they wait for a slot ahead of a new request of ``priority``."""
        return len(self._admitted_ahead(priority, now))

    def _admitted_ahead(self, priority: int, now: float) -> list[_Admitted]:
        return [a for a in self.admitted if now - a.at <= MAX_UNREPORTED_AGE_S
                and (a.priority is None or a.priority <= priority)]


class ClusterView:
    def __init__(self) -> None:
        self._workers: dict[str, WorkerEntry] = {}

    def set_workers(self, infos: list[WorkerInfo]) -> None:
        """Replace the registry snapshot; a worker that left is forgotten with its load."""
        entries = {}
        for info in infos:
            entry = self._workers.get(info.worker_id) or WorkerEntry(info)
            entry.info = info
            entries[info.worker_id] = entry
        self._workers = entries

    def update_load(self, load: WorkerLoad, now: float) -> None:
        entry = self._workers.get(load.worker_id)
        if entry is None or (entry.load is not None and load.seq <= entry.load.seq):
            return  # unknown (not registered yet / gone) or out of order
        entry.load, entry.load_received_at = load, now
        # Admissions before the report's timestamp are counted in it now.
        entry.admitted = [a for a in entry.admitted if a.at > load.timestamp]

    def note_admitted(self, worker_id: str, num_blocks: int, now: float, priority: int | None = None) -> None:
        if entry := self._workers.get(worker_id):
            entry.admitted.append(_Admitted(now, num_blocks, priority))

    def ready_workers(self, role: Role, model: str | None = None) -> list[WorkerEntry]:
        return [e for e in self._workers.values() if is_ready_worker(e.info, role, model)]

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self._workers.get(worker_id)

    def status(self, now: float) -> ClusterStatusResult:
        return ClusterStatusResult(timestamp=now, workers=[
            WorkerStatus(info=e.info, load=e.load,
                         load_age_s=None if e.load_received_at is None else now - e.load_received_at)
            for e in sorted(self._workers.values(), key=lambda e: e.info.worker_id)])
