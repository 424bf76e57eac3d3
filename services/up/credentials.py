"""``tandem credentials rotate|finish``: ask the running ``tandem up`` to rotate its embedded NATS's
login, with an overlap window in which the old and the new one both log in (services/stack/rotate.py)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.framework.command import register_command
from services.up.config import default_state_dir

HELP = "rotate the embedded NATS's login of a running tandem up, the old one accepted for an overlap window"
ROTATE_HELP = ("make a new NATS login: the running tandem up's NATS accepts it and the old one for --overlap-s, "
               "rewrites connect.env with it and restarts its own services with it one at a time; copy the new "
               "connect.env over the old one on every joined host within the window (a running tandem join "
               "takes it over), after which the old login is refused")
FINISH_HELP = "end a rotation's overlap now: the old NATS login is refused from now on"
EPILOG = ("exit codes: 0 done; 1 tandem up refused (a rotation already under way, a NATS it did not start, "
          "its services still restarting); 3 no tandem up answered for this --state-dir and --namespace")


class CredentialsSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid")

    state_dir: Path = Field(default_factory=default_state_dir, description="the running tandem up's --state-dir")
    namespace: str = Field("tandem", pattern=r"^[A-Za-z0-9_-]{1,64}$", description="the running tandem up's "
                           "--namespace (its state is <state-dir>/<namespace>)")
    answer_timeout_s: float = Field(30.0, gt=0, description="give up (exit 3) when tandem up has not answered "
                                    "within this")


class RotateSettings(CredentialsSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="forbid")

    overlap_s: float = Field(3600.0, gt=0, description="how long the old login stays accepted: time enough to "
                             "copy connect.env over the old one on every joined host")


def register(subparsers) -> None:
    parser = subparsers.add_parser("credentials", help=HELP, description=HELP, epilog=EPILOG)
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    register_command(actions, "rotate", ROTATE_HELP, RotateSettings, rotate, epilog=EPILOG)
    register_command(actions, "finish", FINISH_HELP, CredentialsSettings, finish, epilog=EPILOG)
    parser.set_defaults(func=lambda _args: parser.print_help() or 2)


def rotate(settings: RotateSettings) -> int:
    from services.stack.rotate import CredentialsRequest  # noqa: PLC0415

    return _ask(settings, CredentialsRequest("rotate", settings.overlap_s))


def finish(settings: CredentialsSettings) -> int:
    from services.stack.rotate import CredentialsRequest  # noqa: PLC0415

    return _ask(settings, CredentialsRequest("finish"))


def _ask(settings: CredentialsSettings, request) -> int:
    from services.framework.errors import CliError  # noqa: PLC0415
    from services.stack.rotate import send_request, wait_answer  # noqa: PLC0415

    directory = settings.state_dir / settings.namespace / "nats"
    if not directory.is_dir():
        raise CliError(f"{directory} does not exist: no tandem up ran with this --state-dir and --namespace", 3)
    answer = wait_answer(directory, send_request(directory, request), settings.answer_timeout_s)
    if answer is None:
        raise CliError(f"no tandem up answered within {settings.answer_timeout_s:g}s for {directory} (is it "
                       "running, with this --state-dir and --namespace?); nothing changed", 3)
    if not answer.is_done:
        raise CliError(answer.message, 1)
    print(answer.message)
    return 0
