"""``tandem up``: the whole stack on this machine until Ctrl-C, which stops every process."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from services.framework.errors import CliError
from services.stack.rotate import Rotator
from services.stack.servers import advertised_host
from services.stack.stack import Stack, StackSpec, print_line
from services.stack.supervisor import Backoff
from shared.telemetry.redact import new_secret, redact_url
from services.up.config import UpSettings
from services.up.plan import planned_host


def spec_from_settings(s: UpSettings) -> StackSpec:
    decode_flags, prefill_flags = s.worker_flags()
    num_decode, num_prefill, worker_flags, rank_flags = s.decode, s.prefill, s.group_worker_flags(), {}
    if s.plan is not None:
        planned = planned_host(s, "up")
        num_decode, num_prefill, worker_flags, rank_flags = (planned.num_decode, planned.num_prefill,
                                                             planned.worker_flags, planned.rank_flags)
    return StackSpec(
        state_dir=s.state_dir / s.namespace, num_decode=num_decode, num_prefill=num_prefill, worker_flags=worker_flags,
        rank_flags=rank_flags,
        num_gateways=s.gateways, num_admissions=s.admissions, model=s.model,
        host=s.host, port=s.port, namespace=s.namespace, nats_url=s.nats_url, redis_url=s.redis_url,
        nats_cluster=s.nats_cluster, nats_host=s.nats_host, nats_port=s.nats_port, advertise_host=s.advertise_host,
        nats_tls=s.nats_tls, nats_ca=s.nats_ca, nats_replicas=s.nats_replicas,
        registry_ttl_s=s.registry_ttl_s, log_level=s.log_level, metrics_host=s.metrics_host,
        metrics_key_file=s.metrics_key_file or s.operator_key_file, restart_children=s.restart,
        restart_backoff=Backoff(max_s=s.restart_max_backoff_s),
        decode_flags=decode_flags, prefill_flags=prefill_flags,
        gateway_flags=_given(qos=s.qos, api_keys=s.api_keys, api_keys_file=s.api_keys_file,
                             operator_key_file=s.operator_key_file, rate_limit_per_s=s.rate_limit_per_s,
                             rate_limit_burst=s.rate_limit_burst),
        admission_flags=_given(qos=s.qos), **_autoscaling(s))


def _autoscaling(s: UpSettings) -> dict[str, object]:
    """The autoscaler acts, and tandem up starts and stops the workers it asks for (a fleet whose
    bounds are equal only flips roles)."""
    if not s.autoscale:
        return {}
    low, high = s.fleet_bounds()
    fleet = {"min_workers": low, "max_workers": high} if high > low else {}
    return {"autoscaler_flags": {"autoscale": True, **fleet},
            "fleet_drain_timeout_s": s.scale_down_drain_timeout_s if fleet else None}


def _given(**flags: object) -> dict[str, object]:
    return {k: v for k, v in flags.items() if v is not None}


def run(settings: UpSettings) -> int:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        spec = spec_from_settings(settings)
    except (OSError, ValueError) as exc:  # a plan file that cannot be read or run (PlanNotRunnable)
        if settings.plan is None:
            raise
        raise CliError(f"--plan {settings.plan}: {exc}") from None
    stack = Stack(spec)
    try:
        stack.start()
        # now, not at ready: the hosts of ranks of this host's workers join with it before those are ready
        connect = write_connect_file(stack)
        if any("group_local_ranks" in flags for flags in spec.worker_flags.values()):
            print_line("up", f"workers with ranks on other hosts wait for them: join those hosts with {connect}")
        if spec.num_decode or spec.num_prefill:
            print_line("up", f"starting {spec.num_decode} decode and {spec.num_prefill} prefill worker(s) of "
                             f"{settings.model}; waiting for {stack.base_url}/ready")
        else:
            print_line("up", f"starting the control plane alone (no workers: register your own, see "
                             f"docs/services.md); waiting for {stack.base_url}/ready")
        waiter = threading.Thread(target=_wait_ready, args=(stack, settings, stop, connect), daemon=True)
        waiter.start()
        rotator = Rotator(stack, lambda: write_connect_file(stack), new_secret)  # tandem credentials
        while not stop.wait(0.5):
            rotator.poll(time.time())
            dead = stack.exited()
            if dead and not settings.restart:  # else the stack's supervisor restarts them
                print_line("up", f"exited: {', '.join(dead)}; stopping the stack")
                return 1
        return 0
    finally:
        print_line("up", "stopping")
        stack.stop()
        print_line("up", "stopped")


def _wait_ready(stack: Stack, settings: UpSettings, stop: threading.Event, connect: Path) -> None:
    """Say ready, naming ``connect`` (written at start), or stop the stack when it is not in time."""
    try:
        stack.wait_ready(settings.ready_timeout_s)
    except (RuntimeError, TimeoutError) as exc:
        print_line("up", f"not ready: {exc}")
        stop.set()
        return
    urls = "  ".join(stack.base_urls)
    print_line("up", f"ready: {urls}  (OpenAI base URL {stack.base_url}/v1; NATS {redact_url(stack.nats_url)}, "
                     f"Redis {redact_url(stack.redis_url)}, namespace {stack.spec.namespace}; "
                     f"credentials in {connect}; Ctrl-C stops)")


def gateway_url(stack: Stack) -> str:
    """The first gateway's URL as other processes and hosts dial it (a wildcard listen address:
    this machine's address)."""
    host = advertised_host(stack.spec.host)
    return f"http://{f'[{host}]' if ':' in host else host}:{stack.port}"


def write_connect_file(stack: Stack) -> Path:
    """``connect.env`` in the stack's state directory, readable by its owner only: the NATS URL with
    its password and the namespace, as the ``TANDEM_*`` variables every command and the example
    workers read (``set -a; . connect.env; set +a``). No Redis URL: only the control plane's own
    gateway and kv-index use Redis, which listens on this host's loopback, so a joined host could
    not use it, and its password stays on this host."""
    path = stack.spec.state_dir / "connect.env"
    path.touch(mode=0o600)
    path.chmod(0o600)
    lines = [f"TANDEM_NATS_URL={stack.nats_url}",
             f"TANDEM_NAMESPACE={stack.spec.namespace}", f"TANDEM_REGISTRY_TTL_S={stack.spec.registry_ttl_s:g}",
             f"TANDEM_GATEWAY_URL={gateway_url(stack)}"]  # `tandem status` reads it
    if stack.nats_ca:  # a joining host copies it beside this file: tandem join looks there too
        lines.append(f"TANDEM_NATS_CA={stack.nats_ca}")
    if stack.nats_replicas:
        lines.append(f"TANDEM_NATS_REPLICAS={stack.nats_replicas}")
    path.write_text("\n".join(lines) + "\n")
    return path
