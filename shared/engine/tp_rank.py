"""A follower rank of a parallel engine: as rank 0 starts it on its own host (``shared.engine.parallel``,
``python -m shared.engine.tp_rank --rank R --size N --host H --port P --config JSON --log-level L``),
or as ``tandem rank --join H:P`` starts it on another host (``join_group``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket

import torch

from shared.engine.parallel import follow
from shared.model.parallel import ProcessGroupCollectives

log = logging.getLogger(__name__)


def follower_main(argv: list[str] | None = None) -> int:
    """A follower rank started by rank 0 on its host: join the group, follow rank 0 until it stops."""
    import argparse

    from shared.engine.config import EngineConfig

    parser = argparse.ArgumentParser(prog="python -m shared.engine.tp_rank",
                                     description="One follower rank of a parallel engine (started by rank 0).")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--host", required=True, help="rank 0's address")
    parser.add_argument("--port", type=int, required=True, help="rank 0's rendezvous port")
    parser.add_argument("--config", required=True, help="the engine config, as JSON")
    parser.add_argument("--log-level", default="INFO", help="rank 0's (default: %(default)s)")
    args = parser.parse_args(argv)
    _log_as(args.rank, args.log_level)
    config = EngineConfig(**json.loads(args.config))
    device = _rank_device(config, args.rank)
    return run_rank(config, args.rank, lambda: ProcessGroupCollectives(
        args.rank, args.size, args.host, args.port, device, shared_memory=config.local_ranks == args.size))


def join_group(host: str, port: int, rank: int, size: int | None = None, bind_host: str | None = None,
               device: str | None = None, log_level: str = "INFO") -> int:
    """A rank started on another host than rank 0's (``tandem rank``): read the engine config from
    rank 0's store at ``host:port``, load this rank's shard (the model's path must hold the same
    files here), follow rank 0 until the group ends. ``size``: the group's ranks (default: the
    config's tp x pp; given, it must be that). Gloo's connections bind ``bind_host`` (default:
    this host's address on the route to ``host``). Returns 1 when the group ended with a rank gone."""
    import datetime

    import torch.distributed as dist

    from shared.engine.config import EngineConfig
    from shared.engine.parallel import CONFIG_KEY, REMOTE_JOIN_TIMEOUT_S

    _log_as(rank, log_level)
    timeout = datetime.timedelta(seconds=REMOTE_JOIN_TIMEOUT_S)
    store = dist.TCPStore(host, port, None, is_master=False, timeout=timeout)
    config = EngineConfig(**json.loads(store.get(CONFIG_KEY)))
    group_size = config.tensor_parallel_size * config.pipeline_parallel_size
    if size is not None and size != group_size:
        raise ValueError(f"the group at {host}:{port} has {group_size} ranks (tp {config.tensor_parallel_size} x "
                         f"pp {config.pipeline_parallel_size}), not --size {size}")
    size = group_size
    if device is not None:
        config = dataclasses.replace(config, device=device)
    local = config.local_ranks
    if rank < local or rank >= size:
        raise ValueError(f"rank {rank} is not one that joins from another host: rank 0 starts ranks 0-{local - 1} "
                         f"of {size} itself")
    bind_host = bind_host or route_address(host)
    log.info("rank %d of %d joins the group at %s:%d from %s (model %s)", rank, size, host, port, bind_host,
             config.model)
    resolved = _rank_device(config, rank - local) if device is None else config.resolve_device()
    return run_rank(config, rank, lambda: ProcessGroupCollectives(
        rank, size, host, port, resolved, shared_memory=False, store=store, bind_host=bind_host))


def run_rank(config, rank: int, make_group) -> int:
    """Make the group, load this rank's shard of ``config``'s model, follow rank 0 until it stops:
    0 when rank 0 ended the group, 1 when a rank is gone."""
    from shared.engine.build import load_model

    torch.set_num_threads(config.num_threads or 1)
    try:
        world = make_group()
        loaded = load_model(config, world=world)
        follow(loaded.model, world)
    except RuntimeError as exc:  # rank 0 or another rank is gone: the group is over
        log.warning("rank %d leaves its tensor-parallel group: %s", rank, exc)
        return 1
    return 0


def route_address(host: str) -> str:
    """This host's address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def _rank_device(config, index: int) -> torch.device:
    """The config's device; on CUDA the ``index``-th GPU after the configured one (rank r of a host)."""
    device = config.resolve_device()
    if device.type == "cuda":
        device = torch.device("cuda", (device.index or 0) + index)
        torch.cuda.set_device(device)
    return device


def _log_as(rank: int, level: str) -> None:
    logging.basicConfig(level=level.upper(), format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")


if __name__ == "__main__":
    raise SystemExit(follower_main())
