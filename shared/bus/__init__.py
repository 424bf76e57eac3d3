"""The only package that imports nats: connection, request/reply, streams, serving, registry."""

from shared.bus.bus import Bus
from shared.bus.errors import BusTimeout, NoResponders, RemoteError, ServiceError
from shared.bus.registry import WorkerRegistry

__all__ = ["Bus", "BusTimeout", "NoResponders", "RemoteError", "ServiceError", "WorkerRegistry"]
