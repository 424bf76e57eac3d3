"""A follower rank of a tensor-parallel engine, as rank 0 starts it (``shared.engine.parallel``):
``python -m shared.engine.tp_rank --rank R --size N --host H --port P --config JSON --log-level L``."""

from __future__ import annotations

import json
import logging

import torch

from shared.engine.parallel import follow
from shared.model.parallel import ProcessGroupCollectives

log = logging.getLogger(__name__)


def follower_main(argv: list[str] | None = None) -> int:
    """A follower rank: join the group, load this rank's shard, follow rank 0 until it stops."""
    import argparse

    from shared.engine.build import load_model
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
    rank = args.rank
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    config = EngineConfig(**json.loads(args.config))
    torch.set_num_threads(config.num_threads or 1)
    device = config.resolve_device()
    if device.type == "cuda":  # rank r on the GPU r after rank 0's
        device = torch.device("cuda", (device.index or 0) + rank)
        torch.cuda.set_device(device)
    try:
        world = ProcessGroupCollectives(rank, args.size, args.host, args.port, device)
        loaded = load_model(config, world=world)
        follow(loaded.model, world)
    except RuntimeError as exc:  # rank 0 or another rank is gone: the group is over
        log.warning("rank %d leaves its tensor-parallel group: %s", rank, exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(follower_main())
