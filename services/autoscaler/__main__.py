"""``tandem autoscaler``: the cluster view (registry + load) that ``/status`` shows."""

import sys

from services.autoscaler.config import AutoscalerSettings
from shared.runtime.command import register_service, run_as_main


def register(subparsers) -> None:
    register_service(subparsers, "autoscaler", "run the autoscaler (first version: aggregates worker load into the cluster view)",
                     AutoscalerSettings, "services.autoscaler.service:run")


if __name__ == "__main__":
    sys.exit(run_as_main("autoscaler"))
