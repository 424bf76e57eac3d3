"""``tandem prefill``: a prefill worker pulling the global prefill queue, writing KV with NIXL."""

import sys

from services.prefill.config import PrefillSettings
from shared.runtime.command import register_service, run_as_main


def register(subparsers) -> None:
    register_service(subparsers, "prefill", "run a prefill worker (pulls the JetStream prefill queue, computes "
                     "prompt KV, writes it into decode workers' blocks over NIXL, then acks)",
                     PrefillSettings, "services.prefill.service:run")


if __name__ == "__main__":
    sys.exit(run_as_main("prefill"))
