"""``tandem gateway`` (the OpenAI-compatible HTTP API) and ``tandem status`` (its cluster view)."""

import argparse
import json
import sys

from services.gateway.config import GatewaySettings
from shared.runtime.command import register_service

HELP = "run the HTTP gateway (OpenAI chat/completions, SSE, /metrics, /status)"
STATUS_HELP = "print the cluster view (workers, role, state, load) from a running gateway"


def register(subparsers) -> None:
    register_service(subparsers, "gateway", HELP, GatewaySettings, "services.gateway.service:run")
    status = subparsers.add_parser("status", help=STATUS_HELP, description=STATUS_HELP)
    status.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL (default: %(default)s)")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    status.set_defaults(func=status_main)


def status_main(args: argparse.Namespace) -> int:
    import urllib.error
    import urllib.request

    from shared.cli.main import CliError

    url = args.url.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            view = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise CliError(f"cannot read {url}: {exc}") from None
    if args.json:
        print(json.dumps(view, indent=2))
        return 0
    print(format_status(view))
    return 0


def format_status(view: dict) -> str:
    header = f"{'WORKER':<28} {'ROLE':<8} {'STATE':<9} {'MODEL':<16} {'RUN':>4} {'WAIT':>5} " \
             f"{'KV USED':>11} {'REQS':>6} {'TOKENS':>8} {'TTFT ms':>8} {'ITL ms':>7} " \
             f"{'PREFILL R/L/F':>14} {'KV MB IN/OUT':>13}"
    lines = [f"source: {view.get('source')}   in flight at gateway: "
             f"{view.get('gateway', {}).get('in_flight', 0):g}"]
    if queue := view.get("prefill_queue"):
        lines.append(f"prefill queue: {queue['num_pending']} waiting, {queue['num_ack_pending']} being prefilled, "
                     f"{queue['num_redelivered']} redelivered")
    lines.append(header)
    for w in view.get("workers", []):
        info, load = w["info"], w.get("load") or {}

        def ms(key):
            return f"{load[key] * 1000:.1f}" if load.get(key) is not None else "-"

        kv = f"{load.get('num_blocks_used', 0)}/{load.get('num_blocks_total', info.get('num_blocks_total', 0))}"
        lines.append(f"{info['worker_id']:<28} {info['role']:<8} {info['state']:<9} {info['model']:<16} "
                     f"{load.get('num_running', 0):>4} {load.get('num_waiting', 0):>5} {kv:>11} "
                     f"{load.get('num_requests_total', 0):>6} {load.get('num_generated_tokens_total', 0):>8} "
                     f"{ms('ttft_recent_s'):>8} {ms('itl_recent_s'):>7} {_prefills(load):>14} "
                     f"{load.get('kv_bytes_received', 0) / 1e6:>6.1f}/{load.get('kv_bytes_sent', 0) / 1e6:<6.1f}")
    if not view.get("workers"):
        lines.append("(no workers registered)")
    return "\n".join(lines)


def _prefills(load: dict) -> str:
    """Decode: remote/local/fallback prefills; prefill: written/-/dropped."""
    if not load:
        return "-"
    if load.get("role") == "prefill":
        return f"{load.get('num_remote_prefills', 0)}/-/{load.get('num_prefills_dropped', 0)}"
    return (f"{load.get('num_remote_prefills', 0)}/{load.get('num_local_prefills', 0)}/"
            f"{load.get('num_prefill_fallbacks', 0)}")


if __name__ == "__main__":
    from shared.runtime.command import run_as_main

    sys.exit(run_as_main("gateway"))
