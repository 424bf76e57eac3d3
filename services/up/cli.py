"""``tandem up``: nats-server, redis-server and every service as local processes."""

from services.framework.command import register_command
from services.up.config import UpSettings

HELP = "start the whole stack locally (embedded NATS + Redis, every service its own process)"


def register(subparsers) -> None:
    register_command(subparsers, "up", HELP, UpSettings, run)


def run(settings: UpSettings) -> int:
    from services.up.service import run as run_up  # noqa: PLC0415 — the stack's modules only when it runs

    return run_up(settings)
