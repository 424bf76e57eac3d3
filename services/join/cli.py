"""``tandem join``: this host's workers, registered with a control plane that runs elsewhere."""

from services.framework.command import register_command
from services.join.config import JoinSettings

HELP = ("start decode/prefill workers on this host for a control plane elsewhere (tandem up on another "
        "host), with the credentials from its connect.env")

# the numbers are shared.bus.errors' exit_code and services.join.service's (a unit test keeps them
# equal); written out here so that --help imports no nats
EXIT_CODES = ("Exit codes, each failure with one line on stderr naming its cause: 0 stopped by Ctrl-C or "
              "SIGTERM; 1 a worker exited under --no-restart; 2 bad settings or connect file; 3 the control "
              "plane's NATS not reachable within --ready-timeout-s (address, port, firewall); 4 TLS failed (the "
              "CA file is not the control plane's ca.pem, or the address is not one its certificate names); "
              "5 credentials refused (copy connect.env from the control plane again: tandem up makes a fresh "
              "password each run), at the start or when a worker's login is refused later; 6 workers not ready "
              "in the control plane's registry within --ready-timeout-s; 7 another host's workers are live under "
              "the worker ids this host would use (the same --host-name: machines cloned from one image share "
              "their host name), refused before any worker starts; 8 the control plane runs another Tandem release "
              "line (major.minor) than this host: patch releases mix, a new line goes on the control plane "
              "first, then on every host.")


def register(subparsers) -> None:
    register_command(subparsers, "join", HELP, JoinSettings, run, epilog=EXIT_CODES)


def run(settings: JoinSettings) -> int:
    from services.join.service import run as run_join  # noqa: PLC0415 — the stack's modules only when it runs

    return run_join(settings)
