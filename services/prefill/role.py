"""The prefill role as a worker process builds it (``services.worker.process``, which imports no role
package: ``tandem decode`` and ``tandem prefill`` hand it this builder and the decode one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.prefill.config import PrefillSettings
from services.worker.role_builder import RoleBuilder, RoleParts

if TYPE_CHECKING:
    from services.prefill.service import PrefillWorker


def wants_transfer(settings: PrefillSettings) -> bool:
    """Always: a prefill role writes every prompt's KV into a decode worker's blocks."""
    return True


def build(settings: PrefillSettings, parts: RoleParts) -> PrefillWorker:
    from services.prefill.service import PrefillWorker  # noqa: PLC0415 — torch, nats only when it runs

    return PrefillWorker(settings, parts.bus, parts.registry, parts.engine, parts.transfer, parts.store,
                         load_seq=parts.load_seq, metrics=parts.metrics)


PREFILL = RoleBuilder(PrefillSettings, wants_transfer, build)
