"""A joined host's identity, beside its name: two hosts under one name (cloned machines share their
host name) would otherwise use the same worker ids, each taking the other's registry entries for
its own and overwriting the other's NIXL transfer metadata.

The host id is random, made by the first ``tandem join`` in its state directory and kept there, so
that a join restarted on the same host (after a crash, its workers' entries still live) is the
same host; its workers carry it in their registry entries (``WorkerInfo.host_id``). Pure but for
the file: the join reads the registry and passes its entries in.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from services.framework.errors import CliError

if TYPE_CHECKING:
    from shared.protocol.workers import WorkerInfo

HOST_ID_FILE = "host-id"
EXIT_HOST_NAME_TAKEN = 7  # another host's workers are live under the worker ids this join would use
_HOST_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # the worker setting's pattern


def load_host_id(state_dir: Path) -> str:
    """This host's id from ``state_dir/host-id``, made (16 random hex digits) the first time."""
    path = state_dir / HOST_ID_FILE
    try:
        host_id = path.read_text().strip()
    except FileNotFoundError:
        state_dir.mkdir(parents=True, exist_ok=True)
        fresh = state_dir / f".{HOST_ID_FILE}.{os.getpid()}"
        fresh.write_text(secrets.token_hex(8) + "\n")
        try:  # a link, not a rename: of two joins starting at once on one state directory, one id wins
            os.link(fresh, path)
        except FileExistsError:
            pass
        finally:
            fresh.unlink()
        host_id = path.read_text().strip()
    except OSError as exc:
        raise CliError(f"cannot read this host's id from {path}: {exc.strerror}") from None
    if not _HOST_ID.match(host_id):
        raise CliError(f"{path} holds no host id ({host_id[:40]!r}): delete it, and a new one is made")
    return host_id


def live_conflicts(entries: Iterable[WorkerInfo], worker_ids: Iterable[str], host_id: str) -> list[WorkerInfo]:
    """The registry entries under one of ``worker_ids`` that another host wrote (another host id,
    or none: a worker older than host ids, or a worker of your own under that id).

    ``entries`` are the registry bucket's: each was put within the registry TTL (the bucket's
    ``max_age`` drops the others, by the NATS server's clock), so all of them are live; comparing
    ``heartbeat_at`` with this host's clock would miss a live host whose clock runs behind."""
    wanted = set(worker_ids)
    return sorted((e for e in entries if e.worker_id in wanted and e.host_id != host_id),
                  key=lambda e: e.worker_id)


def describe_conflict(host_name: str, conflicts: list[WorkerInfo], now_s: float) -> str:
    """The one line a join refused for ``conflicts`` prints."""
    workers = ", ".join(f"{e.worker_id} (pid {e.pid} on {e.host or '?'}, host id {e.host_id or 'none'}, "
                        f"last beat {_ago(e.heartbeat_at, now_s)})" for e in conflicts)
    return (f"cannot join: another host already joined as {host_name!r}, its workers are live in the control "
            f"plane's registry: {workers}; give this host a name of its own with --host-name (machines cloned "
            f"from one image share their host name)")


def is_ready_here(entry: WorkerInfo, host_id: str | None, since_s: float) -> bool:
    """``entry`` is a ready worker this join started: its host id, started after ``since_s`` (this
    host's clock, as the worker's ``started_at``), not an entry a crashed run left behind."""
    return entry.state == "ready" and entry.host_id == host_id and entry.started_at >= since_s


def _ago(timestamp_s: float, now_s: float) -> str:
    if timestamp_s <= 0:
        return "at an unknown time"
    return f"{max(0.0, now_s - timestamp_s):.1f}s ago"


EXIT_RELEASE_MISMATCH = 8  # the control plane runs a release this host's cannot work with
CONTROL_PLANE_SERVICES = ("gateway", "admission", "kv-index", "autoscaler")


def release_line(version: str) -> tuple[int, ...] | None:
    """A release's major and minor number (``0.1.7`` -> (0, 1)); None for an empty or unreadable one."""
    match = re.match(r"^(\d+)\.(\d+)(?:\.|$)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def release_mismatch(own: str, control_plane: Iterable[str]) -> str | None:
    """Why a host of release ``own`` cannot join a control plane whose services run
    ``control_plane`` (None: it can). The rule: releases of the same major and minor number work
    together and patch releases mix, so one host at a time can be upgraded to the next patch; a
    new minor or major release is one the control plane is upgraded to first, then every host.
    Services that do not say their release (before it was published) are passed over."""
    mine = release_line(own)
    others = sorted({v for v in control_plane if release_line(v) not in (None, mine)})
    if mine is None or not others:
        return None
    return (f"cannot join: the control plane runs Tandem {', '.join(others)} and this host {own}; releases mix "
            f"only within one major.minor line (patch releases do): install the control plane's release here")
