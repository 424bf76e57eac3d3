"""A plan as the workers ``tandem up --plan FILE`` starts: one per planned worker, with its role,
its parallel shape and its device, named as tandem up names its workers (``decode-1``, ...).

A plan over several nodes runs as one share per node (``host_share``): ``tandem up --plan-node N``
on the control plane's node, ``tandem join --plan-node N`` on each other one. A node starts the
workers whose rank 0 (the first of their GPUs) it holds, and the ranks it holds of workers led
from other nodes, which join their rank 0 (``tandem rank``). A worker's ranks on one node are
consecutive; each worker spanning nodes has a group port of its own on its rank 0's node: the
base port plus its place among the spanning workers that node leads, in the plan's order, which
every node computes alike.

A plan is run as written or refused, naming the worker and the reason; nothing is silently
changed. Prefill and decode workers may have different shapes: the KV is re-laid out in transit
(``shared.transfer.relayout``). Idle workers of the plan start nothing.
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
    # a worker whose ranks span nodes: its place among the spanning workers its node leads (its
    # group port's offset); its flags' group_local_ranks say how many ranks start here
    group_index: int | None = None


@dataclass(frozen=True)
class PlannedRanks:
    """Ranks ``first_rank`` .. ``first_rank + len(devices) - 1`` of a worker led from ``leader_node``,
    held by this node: each one a ``tandem rank`` joining its rank 0."""

    plan_id: str
    leader_node: str
    group_index: int            # the worker's group port offset on its leader node
    first_rank: int
    devices: list[str | None]   # each rank's device (cuda:N), None where the leader's config says


@dataclass(frozen=True)
class HostShare:
    node: str
    workers: list[PlannedWorker]
    ranks: list[PlannedRanks]


def workers_from_plan(plan: Plan, device: str = "auto") -> list[PlannedWorker]:
    """The workers to start for a plan of one node on a host whose workers run on ``device`` (cpu,
    cuda, auto): decode workers first, then prefill workers, each in the plan's order."""
    share = host_share(plan, device)
    if not any(w.role == "decode" for w in share.workers):
        raise PlanNotRunnable("the plan has no decode worker: nothing could serve a request")
    return share.workers


def plan_nodes(plan: Plan) -> list[str]:
    return sorted({gpu.split("/")[0] for w in plan.workers if w.role != "idle" for gpu in w.gpus})


def host_share(plan: Plan, device: str = "auto", node: str | None = None) -> HostShare:
    """What ``node`` (default: the plan's only node) starts of ``plan``: the workers it leads, in
    tandem up's names, and the ranks it holds of workers led elsewhere."""
    nodes = plan_nodes(plan)
    if node is None:
        if len(nodes) > 1:
            raise PlanNotRunnable(f"the plan places workers on {len(nodes)} nodes ({', '.join(nodes)}): give "
                                  f"--plan-node, tandem up for the control plane's node, tandem join on the others")
        node = nodes[0] if nodes else ""
    elif node not in nodes:
        raise PlanNotRunnable(f"--plan-node {node}: the plan's nodes are {', '.join(nodes)}")
    workers, ranks, led = [], [], dict.fromkeys(nodes, 0)  # spanning workers each node leads so far
    for role in ("decode", "prefill"):
        number = 0
        for w in (w for w in plan.workers if w.role == role):
            held, leader = _node_ranks(w), _node_of(w.gpus[0])
            index = None
            if len(held) > 1:
                index, led[leader] = led[leader], led[leader] + 1
            if leader == node:
                number += 1
                flags = {**_flags(w, held[node], device), **({"group_local_ranks": len(held[node])}
                                                            if index is not None else {})}
                workers.append(PlannedWorker(f"{role}-{number}", w.worker_id, role, flags, index))
            elif node in held:
                devices = [f"cuda:{_gpu_index(w, gpu)}" if device.startswith("cuda") else None for gpu in held[node]]
                ranks.append(PlannedRanks(w.worker_id, leader, index, _first_rank(w, node), devices))
    return HostShare(node, workers, ranks)


def _node_of(gpu: str) -> str:
    return gpu.split("/")[0]


def _node_ranks(w: WorkerPlan) -> dict[str, list[str]]:
    """The worker's GPUs by node, in rank order; refused where a node's ranks are not consecutive."""
    held: dict[str, list[str]] = {}
    previous = None
    for gpu in w.gpus:
        node = _node_of(gpu)
        if node in held and node != previous:
            raise PlanNotRunnable(f"{w.worker_id}: its ranks on node {node} are not consecutive ({w.gpus})")
        held.setdefault(node, []).append(gpu)
        previous = node
    return held


def _first_rank(w: WorkerPlan, node: str) -> int:
    return next(r for r, gpu in enumerate(w.gpus) if _node_of(gpu) == node)


def _flags(w: WorkerPlan, gpus: list[str], device: str) -> dict[str, object]:
    """A worker's shape, and on CUDA the device of its rank 0: its ranks on this node (``gpus``)
    run on consecutive GPUs from there."""
    flags: dict[str, object] = {}
    if w.tp > 1:
        flags["tensor_parallel_size"] = w.tp
    if w.pp > 1:
        flags["pipeline_parallel_size"] = w.pp
    if device.startswith("cuda"):
        ids = sorted(_gpu_index(w, gpu) for gpu in gpus)
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
