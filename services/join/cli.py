"""``tandem join``: this host's workers, registered with a control plane that runs elsewhere."""

from services.join.config import JoinSettings
from shared.service.command import register_command

HELP = ("start decode/prefill workers on this host for a control plane elsewhere (tandem up on another "
        "host), with the credentials from its connect.env")


def register(subparsers) -> None:
    register_command(subparsers, "join", HELP, JoinSettings, run)


def run(settings: JoinSettings) -> int:
    from services.join.service import run as run_join  # noqa: PLC0415 — the stack's modules only when it runs

    return run_join(settings)
