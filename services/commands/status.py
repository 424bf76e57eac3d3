"""``tandem status``: the cluster view a running gateway serves at ``/status``, as a table."""

from __future__ import annotations

import argparse
import json
import os
import time

from shared.protocol.status import StatusPage
from shared.protocol.workers import ScalingStatus, ServiceInfo, WorkerLoad, WorkerStatus

DEFAULT_GATEWAY_URL = "http://127.0.0.1:8000"
HELP = "print the cluster view (workers, role, state, load) from a running gateway"


def register(subparsers) -> None:
    status = subparsers.add_parser("status", help=HELP, description=HELP)
    status.add_argument("--url", default=os.environ.get("TANDEM_GATEWAY_URL") or DEFAULT_GATEWAY_URL,
                        help="gateway base URL (env TANDEM_GATEWAY_URL, which tandem up writes to connect.env; "
                             "default: %(default)s)")
    status.add_argument("--operator-key-file", default=os.environ.get("TANDEM_OPERATOR_KEY_FILE"),
                        help="the gateway's operator key file, when it has one (env TANDEM_OPERATOR_KEY_FILE)")
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    status.set_defaults(func=status_main)


def status_main(args: argparse.Namespace) -> int:
    import urllib.error
    import urllib.request

    from services.framework.errors import CliError
    from shared.openai_api.auth import operator_headers
    from shared.planner.config import ConfigError

    url = args.url.rstrip("/") + "/status"
    try:
        request = urllib.request.Request(url, headers=operator_headers(args.operator_key_file))
        with urllib.request.urlopen(request, timeout=5) as resp:
            view = json.load(resp)
        page = StatusPage.model_validate(view)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    except urllib.error.HTTPError as exc:
        hint = " (pass the operator key: --operator-key-file)" if exc.code == 401 else ""
        raise CliError(f"cannot read {url}: {exc}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:  # ValueError: bad JSON or not a status
        raise CliError(f"cannot read {url}: {exc}") from None
    if args.json:
        print(json.dumps(view, indent=2))
    else:
        print(format_status(page, {u: _is_up(u) for u in page.gateway.urls}))
    return 0


def _is_up(base_url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def format_status(page: StatusPage, gateways_up: dict[str, bool] | None = None) -> str:
    """``gateways_up``: each of the stack's gateway URLs and whether it answered /health."""
    header = f"{'WORKER':<28} {'ROLE':<8} {'STATE':<9} {'RST':>3} {'MODEL':<16} {'RUN':>4} {'WAIT':>5} " \
             f"{'KV USED':>11} {'REQS':>6} {'TOKENS':>8} {'TTFT ms':>8} {'ITL ms':>7} " \
             f"{'PREFILL R/L/F':>14} {'KV MB IN/OUT':>13}"
    restarted = f"   gateway restarts: {page.gateway.num_restarts}" if page.gateway.num_restarts else ""
    batch = f" (+{page.gateway.batch_lines_in_flight} batch lines)" if page.gateway.batch_lines_in_flight else ""
    lines = [f"source: {page.source}   in flight at gateway: {page.gateway.in_flight:g}{batch}{restarted}"]
    if page.gateway.nats_url or page.gateway.redis_url:
        lines.append(f"NATS: {page.gateway.nats_url or '-'}   Redis: {page.gateway.redis_url or '-'}")
    if gateways_up:
        lines.append("gateways: " + "  ".join(f"{u} ({'up' if up else 'down'})" for u, up in gateways_up.items()))
    if queue := page.prefill_queue:
        lines.append(f"prefill queue: {queue.num_pending} waiting, {queue.num_ack_pending} being prefilled, "
                     f"{queue.num_redelivered} redelivered")
    lines.append(header)
    lines.extend(_worker_line(w) for w in page.workers)
    if not page.workers:
        lines.append("(no workers registered)")
    if steps := [f"{w.info.worker_id} {w.load.decode_step}" for w in page.workers if w.load is not None]:
        lines.append("decode step (eager, compiling: eager until the compiled step is ready, compiled): "
                     + ", ".join(steps))
    if groups := [w.info for w in page.workers if w.info.tensor_parallel_size * w.info.pipeline_parallel_size > 1]:
        lines.append("parallel workers: " + ", ".join(
            f"{i.worker_id} tp={i.tensor_parallel_size} pp={i.pipeline_parallel_size} "
            f"(rank pids {', '.join(map(str, [i.pid, *i.rank_pids]))} on {i.host}"
            f"{f'; ranks of other hosts joined at {i.group_address}' if i.group_address else ''})" for i in groups))
    lines.extend(line for w in page.workers if (line := _tier_line(w)))
    lines.extend(line for w in page.workers if (line := _fetch_line(w)))
    if page.services:
        lines.extend(_service_lines(page.services, page.timestamp))
    if page.scaling is not None:
        lines.extend(_scaling_lines(page.scaling))
    return "\n".join(lines)


def _service_lines(services: list[ServiceInfo], now: float) -> list[str]:
    """One line per process in the service directory: restarts by its supervisor, how long this
    one has run, its release, and where its metrics are (``-`` for what an older process did not say)."""
    lines = [f"{'SERVICE':<11} {'PID':>8} {'RST':>3} {'UP s':>8} {'VERSION':<8} {'INSTANCE':<40} METRICS"]
    for s in services:
        up = f"{max(0.0, now - s.started_at):.0f}" if s.started_at else "-"
        lines.append(f"{s.service:<11} {s.pid:>8} {s.num_restarts:>3} {up:>8} {s.version or '-':<8} "
                     f"{s.instance_id:<40} {s.metrics_url or '-'}")
    return lines


def _scaling_lines(scaling: ScalingStatus) -> list[str]:
    """The autoscaler's latest reason and its recent decisions, newest last, with what was done."""
    if not scaling.enabled:
        return ["autoscaling: off"]
    lines = [f"autoscaling: on; last tick: {scaling.last_reason or '-'}"]
    for r in scaling.recent[-5:]:
        done = "; ".join(f"{a.kind} {a.worker_id or 'a worker'} {'to' if a.kind == 'flip' else 'as'} {a.role}: "
                         f"{'ok' if a.ok else 'failed'}"
                         + (f" ({a.message})" if a.message else "") for a in r.actions) or "nothing done"
        when = time.strftime("%H:%M:%S", time.localtime(r.timestamp))
        lines.append(f"  {when} prefill {r.num_prefill}->{r.target_prefill}, decode {r.num_decode}->"
                     f"{r.target_decode} ({r.prefill_tokens_per_s:.0f} prompt tok/s, {r.decode_tokens_per_s:.0f} "
                     f"output tok/s): {r.reason}; {done}")
    return lines


def _worker_line(status: WorkerStatus) -> str:
    info = status.info
    # a worker that has not reported yet shows zeros
    load = status.load or WorkerLoad(worker_id=info.worker_id, role=info.role, seq=0, timestamp=0.0)

    def ms(value: float | None) -> str:
        return f"{value * 1000:.1f}" if value is not None else "-"

    kv = f"{load.num_blocks_used}/{load.num_blocks_total if status.load else info.num_blocks_total}"
    return (f"{info.worker_id:<28} {info.role:<8} {info.state:<9} {info.num_restarts:>3} {info.model:<16} "
            f"{load.num_running:>4} {load.num_waiting:>5} {kv:>11} "
            f"{load.num_requests_total:>6} {load.num_generated_tokens_total:>8} "
            f"{ms(load.ttft_recent_s):>8} {ms(load.itl_recent_s):>7} {_prefills(status.load):>14} "
            f"{load.kv_bytes_received / 1e6:>6.1f}/{load.kv_bytes_sent / 1e6:<6.1f}")


def _tier_line(status: WorkerStatus) -> str | None:
    """The KV tiers under a worker's pool, for workers that have them."""
    tiers = status.load.kv_tiers if status.load else None
    if tiers is None:
        return None
    parts = []
    if tiers.host_capacity_blocks:
        parts.append(f"host {tiers.host_blocks}/{tiers.host_capacity_blocks} blocks")
    if tiers.disk_capacity_blocks:
        parts.append(f"disk {tiers.disk_blocks}/{tiers.disk_capacity_blocks} blocks")
    return (f"  KV tiers of {status.info.worker_id}: {', '.join(parts)}; offloaded {tiers.offloaded_host} to host, "
            f"{tiers.offloaded_disk} to disk; onboarded {tiers.onboarded} ({tiers.onboarded_disk} from disk); "
            f"{tiers.disk_read_failures} damaged on disk; prompt tokens from {_hit_ratios(status)}")


def _fetch_line(status: WorkerStatus) -> str | None:
    """Prefix fetches between decode workers, for workers that fetched or lent any."""
    fetch = status.load.kv_fetch if status.load else None
    if fetch is None or not (fetch.num_fetches or fetch.num_failed or fetch.num_lent):
        return None
    return (f"  KV peer fetches of {status.info.worker_id}: fetched {fetch.num_blocks_fetched} blocks in "
            f"{fetch.num_fetches} fetches ({fetch.num_failed} failed, computed instead; {fetch.num_skipped} hints "
            f"not taken); lent {fetch.num_blocks_lent} blocks in {fetch.num_lent}")


def _hit_ratios(status: WorkerStatus) -> str:
    """Shares of the prompt tokens served from the pool, host memory and disk (an onboarded block
    counts once, for the request that brought it back; later hits on it count as pool hits)."""
    load, tiers, block_size = status.load, status.load.kv_tiers, status.info.block_size
    total = load.num_prompt_tokens_total
    from_disk = tiers.onboarded_disk * block_size
    from_host = (tiers.onboarded - tiers.onboarded_disk) * block_size
    from_pool = max(0, load.num_cached_prompt_tokens_total - from_host - from_disk)
    return ", ".join(f"{name} {n / total if total else 0.0:.0%}"
                     for name, n in (("pool", from_pool), ("host", from_host), ("disk", from_disk)))


def _prefills(load: WorkerLoad | None) -> str:
    """Decode: remote/local/fallback prefills; prefill: written/-/dropped."""
    if load is None:
        return "-"
    if load.role == "prefill":
        return f"{load.num_remote_prefills}/-/{load.num_prefills_dropped}"
    return f"{load.num_remote_prefills}/{load.num_local_prefills}/{load.num_prefill_fallbacks}"

