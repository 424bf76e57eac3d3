"""``tandem gateway`` (the OpenAI-compatible HTTP API) and ``tandem status`` (its cluster view)."""

import os

from services.gateway.config import GatewaySettings
from shared.cli.status import DEFAULT_GATEWAY_URL, status_main
from shared.runtime.command import register_service

HELP = "run the HTTP gateway (OpenAI chat/completions, SSE, /metrics, /status)"
STATUS_HELP = "print the cluster view (workers, role, state, load) from a running gateway"


def register(subparsers) -> None:
    register_service(subparsers, "gateway", HELP, GatewaySettings, "services.gateway.service:run")
    status = subparsers.add_parser("status", help=STATUS_HELP, description=STATUS_HELP)
    status.add_argument("--url", default=os.environ.get("TANDEM_GATEWAY_URL") or DEFAULT_GATEWAY_URL,
                        help="gateway base URL (env TANDEM_GATEWAY_URL, which tandem up writes to connect.env; "
                             "default: %(default)s)")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    status.set_defaults(func=status_main)
