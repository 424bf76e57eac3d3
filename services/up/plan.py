"""A plan file as the workers and ranks one host starts (``tandem up --plan``, ``tandem join
--plan``): the host's share of the plan (``shared.planner.launch.host_share``), every worker's
shape checked against the model before anything starts, and the group address of each worker
whose ranks span hosts: its rank 0's ``--group-host`` and the base ``--group-port`` plus its
place, the same on every host."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.framework.errors import CliError
from services.stack.stack import print_line
from services.up.config import WorkerHostSettings


@dataclass(frozen=True)
class PlannedHost:
    num_decode: int
    num_prefill: int
    worker_flags: dict[str, dict[str, object]]  # by worker name: shape, device, group
    rank_flags: dict[str, dict[str, object]]    # by rank process name: tandem rank's flags


def planned_host(s: WorkerHostSettings, label: str) -> PlannedHost:
    """``s.plan``'s share for this host (``s.plan_node``); its lines go out under ``label``."""
    from shared.planner.launch import PlanNotRunnable, host_share
    from shared.planner.plan import Plan

    plan = Plan.model_validate_json(Path(s.plan).read_text())
    if not any(w.role == "decode" for w in plan.workers):
        raise PlanNotRunnable("the plan has no decode worker: nothing could serve a request")
    share = host_share(plan, s.device, s.plan_node)
    _check_shapes(share.workers, s.model, s.quantization)
    workers = {w.name: {**w.flags, **_group(s, w.group_index)} for w in share.workers}
    for w in share.workers:
        print_line(label, f"plan: {w.name} is {w.plan_id} ({w.role}, TP={w.flags.get('tensor_parallel_size', 1)} "
                          f"x PP={w.flags.get('pipeline_parallel_size', 1)}{', ' + str(w.flags['device']) if 'device' in w.flags else ''}"
                          f"{_spans(workers[w.name])})")
    ranks = {}
    for r in share.ranks:
        address = f"{_leader(s, r.leader_node)}:{_group_port(s) + r.group_index}"
        print_line(label, f"plan: ranks {r.first_rank}-{r.first_rank + len(r.devices) - 1} of {r.plan_id} here, "
                          f"joining its rank 0 on {r.leader_node} at {address}")
        for i, device in enumerate(r.devices):
            rank = r.first_rank + i
            ranks[f"rank-{r.plan_id}-{rank}"] = {"join": address, "rank": rank, "log_level": s.log_level,
                                                  **({"device": device} if device else {})}
    return PlannedHost(sum(w.role == "decode" for w in share.workers), sum(w.role == "prefill" for w in share.workers),
                       workers, ranks)


def _check_shapes(workers, model: str, quantization: str | None) -> None:
    from shared.model.loader import read_config
    from shared.model.parallel import check_pipeline_parallel, check_tensor_parallel
    from shared.model.registry import resolve_model
    from shared.planner.launch import PlanNotRunnable

    source = resolve_model(model)
    shape = read_config(source.path, source.format)
    for w in workers:
        try:
            check_tensor_parallel(shape, int(w.flags.get("tensor_parallel_size", 1)), quantization or "none")
            check_pipeline_parallel(shape, int(w.flags.get("pipeline_parallel_size", 1)))
        except ValueError as exc:
            raise PlanNotRunnable(f"{w.plan_id} on {source.name}: {exc}") from None


def _group(s: WorkerHostSettings, index: int | None) -> dict[str, object]:
    if index is None:
        return {}
    return s.group_address(index, "the plan has workers with ranks on other nodes led from this one")


def _group_port(s: WorkerHostSettings) -> int:
    if not s.group_port:
        raise CliError("the plan has workers whose ranks span nodes: give --group-port, the same on every node")
    return s.group_port


def _leader(s: WorkerHostSettings, node: str) -> str:
    leaders = dict(pair.split("=", 1) for pair in (s.plan_leaders or "").split(",") if pair)
    if node not in leaders:
        raise CliError(f"node {node} leads a worker with ranks on this host: give its address with --plan-leaders "
                       f"{node}=ADDRESS")
    return leaders[node]


def _spans(flags: dict[str, object]) -> str:
    local = flags.get("group_local_ranks")
    return f"; ranks 0-{int(local) - 1} here, the others join at {flags['group_host']}:{flags['group_port']}" \
        if local else ""
