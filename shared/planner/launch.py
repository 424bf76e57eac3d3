"""A plan as the workers ``tandem up --plan FILE`` starts: one per planned worker, with its role,
its parallel shape and its device, named as tandem up names its workers (``decode-1``, ...).

A plan is run as written or refused, naming the worker and the reason; nothing is silently
changed. What cannot run yet is refused: a plan over several nodes (tandem up starts one host's
workers; each host's share would be a ``tandem join``). Prefill and decode workers may have
different shapes: the KV is re-laid out in transit (``shared.transfer.relayout``). Idle workers of
the plan start nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.planner.plan import Plan, WorkerPlan


class PlanNotRunnable(ValueError):
    """The plan asks for something this host cannot start; the message names the worker."""


@dataclass(frozen=True)
class PlannedWorker:
    name: str                   # tandem up's name for it: decode-1, prefill-1, ...
    plan_id: str                # the plan's worker id
    role: str
    flags: dict[str, object] = field(default_factory=dict)  # over its role's flags: shape, device


def workers_from_plan(plan: Plan, device: str = "auto") -> list[PlannedWorker]:
    """The workers to start for ``plan`` on a host whose workers run on ``device`` (cpu, cuda,
    auto): decode workers first, then prefill workers, each in the plan's order."""
    active = [w for w in plan.workers if w.role != "idle"]
    nodes = sorted({gpu.split("/")[0] for w in active for gpu in w.gpus})
    if len(nodes) > 1:
        raise PlanNotRunnable(f"the plan places workers on {len(nodes)} nodes ({', '.join(nodes)}): tandem up "
                              f"starts the workers of one host")
    out = []
    for role in ("decode", "prefill"):
        for number, w in enumerate((w for w in active if w.role == role), start=1):
            out.append(PlannedWorker(f"{role}-{number}", w.worker_id, role, _flags(w, device)))
    if not any(w.role == "decode" for w in out):
        raise PlanNotRunnable("the plan has no decode worker: nothing could serve a request")
    return out


def _flags(w: WorkerPlan, device: str) -> dict[str, object]:
    flags: dict[str, object] = {}
    if w.tp > 1:
        flags["tensor_parallel_size"] = w.tp
    if w.pp > 1:
        flags["pipeline_parallel_size"] = w.pp
    if device.startswith("cuda"):
        ids = sorted(_gpu_index(w, gpu) for gpu in w.gpus)
        if ids != list(range(ids[0], ids[0] + len(ids))):
            raise PlanNotRunnable(f"{w.worker_id}: its GPUs {w.gpus} are not consecutive; a parallel worker's "
                                  f"rank r runs on the GPU after rank r - 1's")
        flags["device"] = f"cuda:{ids[0]}"
    return flags


def _gpu_index(w: WorkerPlan, gpu: str) -> int:
    name = gpu.split("/")[-1]
    if not name.startswith("gpu") or not name[3:].isdigit():
        raise PlanNotRunnable(f"{w.worker_id}: cannot read a device index from {gpu!r} (want node/gpuN)")
    return int(name[3:])
