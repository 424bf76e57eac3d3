"""``tandem join``: this host's workers, supervised here, serving a control plane elsewhere.

The control plane (``tandem up`` on another host) wrote ``connect.env``: the NATS URL(s) with their
credentials, the namespace, the registry TTL and, with TLS, its CA file. The workers started here
register in that namespace's registry, so gateway, admission and kv-index see them as they see
local ones; KV moves between hosts over NIXL. Ctrl-C drains and stops them. A new connect file
copied over the old one (after a credentials rotation) is taken over while the join runs
(``services.join.watch``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from services.framework.errors import CliError
from services.join.config import JoinSettings
from services.join.identity import (CONTROL_PLANE_SERVICES, EXIT_HOST_NAME_TAKEN, EXIT_RELEASE_MISMATCH,
                                    describe_conflict, is_ready_here, live_conflicts, load_host_id, release_mismatch)
from services.join.watch import ConnectWatch
from services.stack.stack import Stack, StackSpec, print_line
from services.stack.supervisor import Backoff
from services.up.plan import planned_host
from shared.telemetry.redact import redact_url

if TYPE_CHECKING:
    from shared.bus.bus import Bus

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


def spec_from_settings(s: JoinSettings, connect: dict[str, str], host_id: str | None = None) -> StackSpec:
    """The stack of this host's workers; ``host_id``: this host's (``load_host_id`` of the spec's
    state directory), passed to its workers."""
    decode_flags, prefill_flags = s.worker_flags()
    num_decode, num_prefill, worker_flags, rank_flags = s.decode, s.prefill, s.group_worker_flags(), s.rank_flags()
    if s.plan is not None:
        planned = planned_host(s, "join")
        if not planned.worker_flags and not planned.rank_flags:
            raise CliError(f"--plan {s.plan}: node {s.plan_node} has none of the plan's workers or ranks")
        num_decode, num_prefill, worker_flags = planned.num_decode, planned.num_prefill, planned.worker_flags
        rank_flags = {**rank_flags, **planned.rank_flags}
    namespace = connect.get("TANDEM_NAMESPACE", "tandem")
    replicas = connect.get("TANDEM_NATS_REPLICAS")
    return StackSpec(
        state_dir=join_state_dir(s, namespace), control_plane=False, host_name=s.host_name, host_id=host_id,
        num_decode=num_decode, num_prefill=num_prefill, model=s.model, namespace=namespace,
        nats_url=connect["TANDEM_NATS_URL"], nats_ca=connect.get("TANDEM_NATS_CA"),
        nats_replicas=int(replicas) if replicas else None,
        registry_ttl_s=float(connect.get("TANDEM_REGISTRY_TTL_S", 6.0)), log_level=s.log_level,
        metrics_host=s.metrics_host, metrics_key_file=s.metrics_key_file,
        restart_children=s.restart, restart_backoff=Backoff(max_s=s.restart_max_backoff_s),
        final_exit_codes=frozenset({EXIT_CREDENTIALS_REFUSED}), decode_flags=decode_flags,
        prefill_flags=prefill_flags, worker_flags=worker_flags, rank_flags=rank_flags)


def join_state_dir(s: JoinSettings, namespace: str) -> Path:
    return s.state_dir / f"join-{namespace}"


EXIT_NOT_READY = 6  # workers not in the registry in time; NATS's own causes: shared.bus.errors (3, 4, 5)
# shared.bus.errors.NatsCredentialsRefused's (a unit test keeps them equal): a worker exiting with it
# was refused by NATS, and so will every restart be until connect.env is copied again
EXIT_CREDENTIALS_REFUSED = 5


def run(settings: JoinSettings) -> int:
    connect = read_connect_file(settings.connect)
    if settings.decode + settings.prefill == 0 and not settings.group_join and settings.plan is None:
        raise CliError("nothing to join: give --decode and/or --prefill (or --group-join, or --plan)")
    host_id = load_host_id(join_state_dir(settings, connect.get("TANDEM_NAMESPACE", "tandem")))
    try:
        spec = spec_from_settings(settings, connect, host_id)
    except (OSError, ValueError) as exc:  # a plan file that cannot be read or run (PlanNotRunnable)
        if settings.plan is None:
            raise
        raise CliError(f"--plan {settings.plan}: {exc}") from None
    stack = Stack(spec)
    # before any worker starts: a wrong address, CA or password, or a host name another host's
    # workers use, fails in seconds, not after loading
    asyncio.run(check_control_plane(spec, settings.ready_timeout_s, worker_ids_of(stack)))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    failed: list[CliError] = []  # why the readiness wait gave up, if it did
    started_at = time.time()  # the workers' entries start after this (their started_at, this host's clock)
    try:
        stack.start()
        print_line("join", f"starting {spec.num_decode} decode and {spec.num_prefill} prefill worker(s) of "
                           f"{settings.model} as host {settings.host_name!r} (host id {host_id}) for the control "
                           f"plane at {redact_url(stack.nats_url)} (namespace {stack.spec.namespace})")
        if ranks := spec.rank_flags:
            print_line("join", f"starting {', '.join(ranks)}: ranks of parallel workers led from other hosts "
                               f"(they follow their rank 0's model and settings)")
        threading.Thread(target=_wait_registered, args=(stack, settings, started_at, stop, failed),
                         daemon=True).start()
        watch = ConnectWatch(stack, settings.connect, connect, read_connect_file, _login_check(spec),
                             lambda worker_id, since: asyncio.run(wait_workers_ready(
                                 stack, [worker_id], settings.ready_timeout_s, since)),
                             drain_timeout_s=settings.drain_timeout_s)
        while not stop.wait(0.5):
            watch.poll(time.monotonic())
            dead = stack.exited()
            if refused := refused_workers(stack):
                raise CliError(f"{', '.join(refused)} exited: the control plane's NATS refused the credentials "
                               f"of {settings.connect} (its state directory wiped?): copy connect.env "
                               f"from the control plane again and restart tandem join", EXIT_CREDENTIALS_REFUSED)
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


def _login_check(spec: StackSpec):
    """``check(url, ca)``: raises ``CliError`` (with its exit code) unless NATS at ``url`` takes its
    login, verified with ``ca``, as this host's workers would connect."""
    def check(url: str, ca: str | None) -> None:
        asyncio.run(_try_login(dataclasses.replace(spec, nats_url=url, nats_ca=ca), timeout_s=15.0))
    return check


async def _try_login(spec: StackSpec, timeout_s: float) -> None:
    from shared.bus.bus import Bus  # noqa: PLC0415 — nats only when the command runs
    from shared.bus.errors import NatsUnavailable  # noqa: PLC0415

    try:
        bus = await Bus.connect(spec.nats_url, f"{spec.namespace}-join-{spec.host_name}", timeout_s=timeout_s,
                                tls_ca=spec.nats_ca, replicas=spec.nats_replicas)
    except NatsUnavailable as exc:
        raise CliError(str(exc), exc.exit_code) from None
    await bus.close()


def refused_workers(stack: Stack) -> list[str]:
    """Workers that exited because NATS refused their login: not restarted (the spec's
    ``final_exit_codes``), as every restart would be refused too."""
    return [name for name in stack.exited() if stack.children[name].proc.returncode == EXIT_CREDENTIALS_REFUSED]


def worker_ids_of(stack: Stack) -> list[str]:
    """The ids of the workers ``stack`` starts."""
    names = [*(f"decode-{i + 1}" for i in range(stack.spec.num_decode)),
             *(f"prefill-{i + 1}" for i in range(stack.spec.num_prefill))]
    return [stack.worker_id(name) for name in names]


async def check_control_plane(spec: StackSpec, timeout_s: float, worker_ids: list[str]) -> None:
    """Connect to the control plane's NATS as the workers will, or raise its cause as a CliError
    with that cause's exit code (unreachable within ``timeout_s``, TLS, credentials); then check
    that no other host's workers are live under ``worker_ids`` (exit 7)."""
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
    try:
        await check_host_name(bus, spec, worker_ids)
        await check_release(bus, spec)
    finally:
        await bus.close()


async def check_host_name(bus: Bus, spec: StackSpec, worker_ids: list[str]) -> None:
    """Raise (exit 7) when the registry holds another host's live entry under one of
    ``worker_ids``: a second host under this host name (``services.join.identity``)."""
    from shared.bus.registry import WorkerRegistry  # noqa: PLC0415 — nats only when the command runs
    from shared.protocol.subjects import Subjects  # noqa: PLC0415

    entries = await _read_control_plane("worker registry", WorkerRegistry.open(
        bus, Subjects(spec.namespace).workers_bucket, ttl_s=spec.registry_ttl_s))
    if conflicts := live_conflicts(entries, worker_ids, spec.host_id):
        raise CliError(describe_conflict(spec.host_name, conflicts, time.time()), EXIT_HOST_NAME_TAKEN)
    if own := sorted(e.worker_id for e in entries if e.worker_id in worker_ids):
        print_line("join", f"{', '.join(own)} of this host (host id {spec.host_id}) still in the registry "
                           f"from an earlier run: taken over by the workers starting now")


async def _read_control_plane(what: str, opening) -> list:
    """The entries of one of the control plane's buckets (``opening``: its ``open(...)`` not yet
    awaited), or a CliError (exit 3) naming ``what`` when NATS cannot give them."""
    from shared.bus.errors import NatsUnreachable, ServiceError  # noqa: PLC0415 — nats only when the command runs

    try:
        return await (await opening).list()
    except (ConnectionError, TimeoutError, ServiceError) as exc:
        raise CliError(f"cannot join: reading the control plane's {what} failed: {exc}",
                       NatsUnreachable.exit_code) from None


async def check_release(bus: Bus, spec: StackSpec) -> None:
    """Raise (exit 8) when the control plane's services run a release this host's cannot work with
    (``services.join.identity.release_mismatch``)."""
    from shared import __version__  # noqa: PLC0415
    from shared.bus.services import ServiceDirectory  # noqa: PLC0415 — nats only when the command runs
    from shared.protocol.subjects import Subjects  # noqa: PLC0415

    services = await _read_control_plane("service directory", ServiceDirectory.open(
        bus, Subjects(spec.namespace).services_bucket, ttl_s=spec.registry_ttl_s))
    versions = [s.version for s in services if s.service in CONTROL_PLANE_SERVICES]
    if why := release_mismatch(__version__, versions):
        raise CliError(why, EXIT_RELEASE_MISMATCH)


def _wait_registered(stack: Stack, settings: JoinSettings, started_at: float, stop: threading.Event,
                     failed: list[CliError]) -> None:
    ids = worker_ids_of(stack)
    try:
        asyncio.run(wait_workers_ready(stack, ids, settings.ready_timeout_s, started_at))
    except ConnectionError as exc:  # NATS went away since check_control_plane
        failed.append(CliError(f"not ready: {exc}", getattr(exc, "exit_code", 1)))
    except TimeoutError as exc:
        failed.append(CliError(f"not ready: {exc}", EXIT_NOT_READY))
    else:
        ready = f"{', '.join(ids)} registered with the control plane" if ids else "rank processes started (each joins its group when the group's rank 0 waits for it)"
        print_line("join", f"ready: {ready}; Ctrl-C stops")
        return
    stop.set()


async def wait_workers_ready(stack: Stack, worker_ids: list[str], timeout_s: float, started_at: float) -> None:
    """Until every one of ``worker_ids`` is in the control plane's registry, ready, with this
    host's id and started after ``started_at``: not another host's entry under the same id (one
    that joined since this join's check), nor one an earlier run of this host left."""
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
            ready = {w.worker_id for w in await registry.list()
                     if is_ready_here(w, stack.spec.host_id, started_at)}
            if set(worker_ids) <= ready:
                return
            if time.monotonic() > deadline:
                missing = sorted(set(worker_ids) - ready)
                raise TimeoutError(f"not ready in the registry within {timeout_s:g}s: {', '.join(missing)}")
            await asyncio.sleep(0.5)
    finally:
        await bus.close()
