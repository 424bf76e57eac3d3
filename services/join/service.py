"""``tandem join``: this host's workers, supervised here, serving a control plane elsewhere.

The control plane (``tandem up`` on another host) wrote ``connect.env``: the NATS URL(s) with their
credentials, the namespace, the registry TTL and, with TLS, its CA file. The workers started here
register in that namespace's registry, so gateway, admission and kv-index see them as they see
local ones; KV moves between hosts over NIXL. Ctrl-C drains and stops them.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from pathlib import Path

from services.join.config import JoinSettings
from shared.cli.errors import CliError
from shared.stack.stack import Stack, StackSpec, print_line
from shared.stack.supervisor import Backoff
from shared.telemetry.redact import redact_url

_CONNECT_KEYS = {"TANDEM_NATS_URL", "TANDEM_REDIS_URL", "TANDEM_NAMESPACE", "TANDEM_REGISTRY_TTL_S",
                 "TANDEM_NATS_CA", "TANDEM_NATS_REPLICAS", "TANDEM_GATEWAY_URL"}


def read_connect_file(path: Path) -> dict[str, str]:
    """The ``KEY=VALUE`` lines of a connect.env (comments and blank lines skipped); the CA file, if
    named, is taken where it is named or, when that path does not exist on this host, as ``ca.pem``
    beside the connect file (copied over with it)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise CliError(f"cannot read the connect file {path}: {exc.strerror}") from None
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or key not in _CONNECT_KEYS:
            raise CliError(f"{path}:{number}: expected one of {', '.join(sorted(_CONNECT_KEYS))}=VALUE")
        values[key] = value.strip().strip("'\"")
    if "TANDEM_NATS_URL" not in values:
        raise CliError(f"{path}: no TANDEM_NATS_URL (write it with tandem up, or by hand)")
    if ca := values.get("TANDEM_NATS_CA"):
        beside = path.parent / "ca.pem"
        if not Path(ca).exists():
            if not beside.exists():
                raise CliError(f"{path} names the CA file {ca}, which is not on this host, and there is no "
                               f"{beside}: copy the control plane's CA there")
            values["TANDEM_NATS_CA"] = str(beside)
    return values


def spec_from_settings(s: JoinSettings, connect: dict[str, str]) -> StackSpec:
    decode_flags, prefill_flags = s.worker_flags()
    namespace = connect.get("TANDEM_NAMESPACE", "tandem")
    replicas = connect.get("TANDEM_NATS_REPLICAS")
    return StackSpec(
        state_dir=s.state_dir / f"join-{namespace}", control_plane=False, host_name=s.host_name,
        num_decode=s.decode, num_prefill=s.prefill, model=s.model, namespace=namespace,
        nats_url=connect["TANDEM_NATS_URL"], nats_ca=connect.get("TANDEM_NATS_CA"),
        nats_replicas=int(replicas) if replicas else None,
        registry_ttl_s=float(connect.get("TANDEM_REGISTRY_TTL_S", 6.0)), log_level=s.log_level,
        restart_children=s.restart, restart_backoff=Backoff(max_s=s.restart_max_backoff_s),
        decode_flags=decode_flags, prefill_flags=prefill_flags)


EXIT_NOT_READY = 6  # workers not in the registry in time; NATS's own causes: shared.bus.errors (3, 4, 5)


def run(settings: JoinSettings) -> int:
    connect = read_connect_file(settings.connect)
    if settings.decode + settings.prefill == 0:
        raise CliError("nothing to join: give --decode and/or --prefill")
    spec = spec_from_settings(settings, connect)
    # before any worker starts: a wrong address, CA or password fails in seconds, not after loading
    asyncio.run(check_control_plane(spec, settings.ready_timeout_s))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stack = Stack(spec)
    failed: list[CliError] = []  # why the readiness wait gave up, if it did
    try:
        stack.start()
        print_line("join", f"starting {settings.decode} decode and {settings.prefill} prefill worker(s) of "
                           f"{settings.model} as host {settings.host_name!r} for the control plane at "
                           f"{redact_url(stack.nats_url)} (namespace {stack.spec.namespace})")
        threading.Thread(target=_wait_registered, args=(stack, settings, stop, failed), daemon=True).start()
        while not stop.wait(0.5):
            dead = stack.exited()
            if dead and not settings.restart:
                print_line("join", f"exited: {', '.join(dead)}; stopping")
                return 1
        if failed:
            raise failed[0]
        return 0
    finally:
        print_line("join", "stopping (workers drain first)")
        stack.stop(timeout_s=max(15.0, settings.drain_timeout_s + 10))
        print_line("join", "stopped")


async def check_control_plane(spec: StackSpec, timeout_s: float) -> None:
    """Connect to the control plane's NATS as the workers will, or raise its cause as a CliError
    with that cause's exit code (unreachable within ``timeout_s``, TLS, credentials)."""
    from shared.bus.bus import Bus  # noqa: PLC0415 — nats only when the command runs
    from shared.bus.errors import NatsUnavailable  # noqa: PLC0415

    # asyncio warns when a TLS server hangs up on a refused login ("returning true from
    # eof_received()..."): noise beside the one line that names the cause
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    try:
        bus = await Bus.connect(spec.nats_url, f"{spec.namespace}-join-{spec.host_name}", timeout_s=timeout_s,
                                tls_ca=spec.nats_ca, replicas=spec.nats_replicas)
    except NatsUnavailable as exc:
        raise CliError(f"cannot join: {exc}", exc.exit_code) from None
    await bus.close()


def _wait_registered(stack: Stack, settings: JoinSettings, stop: threading.Event, failed: list[CliError]) -> None:
    worker_ids = sorted(stack.worker_id(name) for name in stack.children)
    try:
        asyncio.run(wait_workers_ready(stack, worker_ids, settings.ready_timeout_s))
    except ConnectionError as exc:  # NATS went away since check_control_plane
        failed.append(CliError(f"not ready: {exc}", getattr(exc, "exit_code", 1)))
    except TimeoutError as exc:
        failed.append(CliError(f"not ready: {exc}", EXIT_NOT_READY))
    else:
        print_line("join", f"ready: {', '.join(worker_ids)} registered with the control plane; Ctrl-C stops")
        return
    stop.set()


async def wait_workers_ready(stack: Stack, worker_ids: list[str], timeout_s: float) -> None:
    """Until every one of ``worker_ids`` is in the control plane's registry, ready."""
    from shared.bus.bus import Bus  # noqa: PLC0415 — nats only when the command runs
    from shared.bus.registry import WorkerRegistry  # noqa: PLC0415
    from shared.protocol.subjects import Subjects  # noqa: PLC0415

    bus = await Bus.connect(stack.nats_url, f"{stack.spec.namespace}-join-{stack.spec.host_name}",
                            tls_ca=stack.nats_ca, replicas=stack.nats_replicas)
    try:
        registry = await WorkerRegistry.open(bus, Subjects(stack.spec.namespace).workers_bucket,
                                             ttl_s=stack.spec.registry_ttl_s)
        deadline = time.monotonic() + timeout_s
        while True:
            ready = {w.worker_id for w in await registry.list() if w.state == "ready"}
            if set(worker_ids) <= ready:
                return
            if time.monotonic() > deadline:
                missing = sorted(set(worker_ids) - ready)
                raise TimeoutError(f"not ready in the registry within {timeout_s:g}s: {', '.join(missing)}")
            await asyncio.sleep(0.5)
    finally:
        await bus.close()
