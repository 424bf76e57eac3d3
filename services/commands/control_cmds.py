"""``tandem control WORKER``: drain a worker, flip it between decode and prefill, or change a decode
worker's disaggregation thresholds at run time, over its control subject."""

from __future__ import annotations

import argparse
import asyncio
import os

HELP = "send a control request to one worker (drain it, flip its role, or set its remote-prefill thresholds)"


def register(subparsers) -> None:
    parser = subparsers.add_parser("control", help=HELP, description=HELP)
    add_worker_args(parser)
    parser.add_argument("--drain", action="store_true", help="finish in-flight work and leave")
    parser.add_argument("--flip", choices=("decode", "prefill"), default=None,
                        help="finish in-flight work, then serve this role in the same process (no reload)")
    parser.add_argument("--max-local-prefill-tokens", type=int, default=None,
                        help="prefill locally up to this many uncached prompt tokens (0: all remote)")
    parser.add_argument("--max-prefill-queue", type=int, default=None,
                        help="prefill locally while the prefill queue is at least this long")
    parser.set_defaults(func=main)


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """A worker id and where to reach it: ``--nats-url`` and ``--namespace`` (also from
    ``TANDEM_NATS_URL`` / ``TANDEM_NAMESPACE``, as in tandem up's connect.env)."""
    from shared.telemetry.redact import redact_url

    parser.add_argument("worker_id", help="the worker's id (see `tandem status`)")
    nats_url = os.environ.get("TANDEM_NATS_URL", "nats://127.0.0.1:4222")
    parser.add_argument("--nats-url", default=nats_url,  # its password stays out of --help
                        help=f"NATS server URL (env TANDEM_NATS_URL, default {redact_url(nats_url)})")
    parser.add_argument("--namespace", default=os.environ.get("TANDEM_NAMESPACE", "tandem"),
                        help="subject namespace (env TANDEM_NAMESPACE, default %(default)s)")


def main(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from services.framework.errors import CliError
    from shared.bus import Bus, ServiceError
    from shared.protocol import ControlRequest, Subjects
    from shared.telemetry.redact import redact_url

    configure = args.max_local_prefill_tokens is not None or args.max_prefill_queue is not None
    if sum((args.drain, configure, args.flip is not None)) > 1:
        raise CliError("--drain, --flip and threshold changes are one request each")
    action = "drain" if args.drain else "flip" if args.flip else "configure" if configure else "status"
    try:
        request = ControlRequest(action=action, role=args.flip,
                                 max_local_prefill_tokens=args.max_local_prefill_tokens,
                                 max_prefill_queue=args.max_prefill_queue)
        endpoint = Subjects(args.namespace).control(args.worker_id)
    except (ValidationError, ValueError) as exc:
        raise CliError(str(exc).splitlines()[0] if isinstance(exc, ValueError) and not isinstance(
            exc, ValidationError) else f"invalid value: {exc.errors()[0]['msg']} "
            f"({exc.errors()[0]['loc'][0]})") from None

    async def send():
        bus = await Bus.connect(args.nats_url, "tandem-control", timeout_s=5)
        try:
            return await bus.request(endpoint, request, timeout_s=10)
        finally:
            await bus.close()

    try:
        result = asyncio.run(asyncio.wait_for(send(), timeout=15))
    except (ConnectionError, asyncio.TimeoutError) as exc:
        raise CliError(f"no answer from {args.worker_id} through NATS at {redact_url(args.nats_url)}: "
                       f"{str(exc) or 'timed out'}") from None
    except ServiceError as exc:
        raise CliError(f"{args.worker_id}: {exc.message}") from None
    print(result.model_dump_json(indent=2))
    return 0
