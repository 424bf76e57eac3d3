"""`tandem rank`: one rank of a parallel worker on another host than its rank 0.

Rank 0 (a worker, `tandem complete`, ... with `--tp`/`--pp`, `--group-local-ranks` fewer than the
group's ranks, `--group-host` an address this host reaches and a fixed `--group-port`) starts the
ranks of its own host and waits for the rest; each of those is one `tandem rank` on its host. It
reads the engine config from rank 0, loads its shard of the same model path, and follows rank 0
until the group ends: exit 0 when rank 0 ended it, 1 when a rank is gone. It waits up to 15
minutes for rank 0 to listen (rank 0 not started yet, or restarting). `tandem join --group-join`
runs these under its supervision, restarting each whenever its group ends.
"""

from __future__ import annotations

import argparse

HELP = "one rank of a parallel worker whose rank 0 runs on another host (joins it at --join HOST:PORT)"


def register(subparsers) -> None:
    parser = subparsers.add_parser("rank", help=HELP, description=HELP + ".\n\n" + __doc__.split("\n\n", 1)[1],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--join", required=True, metavar="HOST:PORT",
                        help="rank 0's --group-host and --group-port")
    parser.add_argument("--rank", type=int, required=True, help="this rank (rank 0's host runs ranks 0 to "
                        "--group-local-ranks - 1; the others are numbered from there)")
    parser.add_argument("--size", type=int, help="the group's ranks, tp x pp (default: rank 0's config's; given, "
                        "a check that it is what this host expects)")
    parser.add_argument("--bind-host", help="this host's address for the group's connections (default: the one "
                        "on the route to rank 0)")
    parser.add_argument("--device", help="this rank's device, where it is not the one rank 0's config names "
                        "(cuda:N on a host with several GPUs)")
    parser.add_argument("--log-level", default="INFO", help="(default: %(default)s)")
    parser.add_argument("--num-restarts", type=int, default=0, help="set by tandem join --group-join, which "
                        "restarts this rank whenever its group ends: how many times it did (its own log says)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from services.framework.errors import CliError
    from shared.engine.tp_rank import join_group

    host, sep, port = args.join.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise CliError(f"--join {args.join!r}: give rank 0's address as HOST:PORT")
    try:
        return join_group(host.strip("[]"), int(port), args.rank, args.size, args.bind_host, args.device,
                          args.log_level)
    except ValueError as exc:
        raise CliError(str(exc)) from None
