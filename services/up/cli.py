"""``tandem up``: nats-server, redis-server and every service as local processes."""

from services.up.config import UpSettings
from shared.service.command import register_command

HELP = "start the whole stack locally (embedded NATS + Redis, every service its own process)"


def register(subparsers) -> None:
    register_command(subparsers, "up", HELP, UpSettings, run)


def run(settings: UpSettings) -> int:
    from services.up.service import run as run_up  # noqa: PLC0415 — the stack's modules only when it runs

    return run_up(settings)
