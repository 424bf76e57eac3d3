"""Which registered workers can take work: the one filter every service applies to the registry."""

from __future__ import annotations

from collections.abc import Iterable

from shared.protocol.workers import Role, WorkerInfo


def is_ready_worker(info: WorkerInfo, role: Role, model: str | None = None) -> bool:
    """``info`` is a ``role`` worker in state ``ready`` (not starting, not draining) serving
    ``model`` (any model when ``model`` is None)."""
    return info.role == role and info.state == "ready" and (model is None or info.model == model)


def ready_workers(infos: Iterable[WorkerInfo], role: Role, model: str | None = None) -> list[WorkerInfo]:
    """The entries of ``infos`` that pass ``is_ready_worker``, in their order."""
    return [info for info in infos if is_ready_worker(info, role, model)]
