"""``tandem autoscaler``: the cluster view that ``/status`` shows, and (``--autoscale``) role flips."""

import sys

from services.autoscaler.config import AutoscalerSettings
from shared.runtime.command import register_service, run_as_main


def register(subparsers) -> None:
    register_service(subparsers, "autoscaler", "run the autoscaler (the cluster view; with --autoscale, flips workers between decode and prefill as the load shifts)",
                     AutoscalerSettings, "services.autoscaler.service:run")


if __name__ == "__main__":
    sys.exit(run_as_main("autoscaler"))
