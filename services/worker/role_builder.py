"""How a worker process builds a role it serves, without importing the role's package.

Each role package (``services.decode.role``, ``services.prefill.role``) defines its ``RoleBuilder``;
the command that starts a process hands it every role it may flip to, so the arrows run from the
role packages to ``services.worker`` and never back. Registration stays cheap: this module and the
builders import no torch or nats; a builder imports its role's service when it builds it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.worker.settings import EngineWorkerSettings

if TYPE_CHECKING:
    from shared.bus import Bus, WorkerRegistry
    from shared.engine import AsyncEngine
    from shared.protocol import Subjects
    from shared.transfer import KvTransfer, MetadataStore
    from services.worker.metrics import WorkerMetrics
    from services.worker.roles import RoleWorker


@dataclass(frozen=True)
class RoleParts:
    """What the process lends a role it builds: ``bus`` is the role's own connection; ``transfer``
    and ``store`` are None where the role did not ask for a KV transfer (or NIXL cannot run)."""

    bus: Bus
    registry: WorkerRegistry
    engine: AsyncEngine
    subjects: Subjects
    load_seq: itertools.count
    metrics: WorkerMetrics | None
    transfer: KvTransfer | None
    store: MetadataStore | None


@dataclass(frozen=True)
class RoleBuilder:
    """A role as its package defines it. ``wants_transfer(settings)``: whether the role needs the
    process's KV transfer opened (and its metadata published) before ``build``; ``build(settings,
    parts)`` returns the role, not yet started."""

    settings_class: type[EngineWorkerSettings]
    wants_transfer: Callable[[Any], bool]
    build: Callable[[Any, RoleParts], RoleWorker]
