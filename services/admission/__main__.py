"""``tandem admission``: admit each request to a decode worker (KV overlap + load) or reject it."""

import sys

from services.admission.config import AdmissionSettings
from shared.runtime.command import register_service, run_as_main


def register(subparsers) -> None:
    register_service(subparsers, "admission", "run the admission service (accept/reject; choose the decode worker)",
                     AdmissionSettings, "services.admission.service:run")


if __name__ == "__main__":
    sys.exit(run_as_main("admission"))
