"""The only package that imports nats: connection, request/reply, streams, serving, work queues,
KV buckets, object stores, registry."""

from shared.bus.bus import Bus
from shared.bus.errors import (BusTimeout, Disconnected, MalformedReply, NatsCredentialsRefused, NatsTlsFailed,
                               NatsUnavailable, NatsUnreachable, NoResponders, RemoteError, ServiceError)
from shared.bus.jetstream import ConsumerState, QueueMessage, StreamState, WorkQueue
from shared.bus.kv import KvBucket
from shared.bus.objects import ObjectBucket, StoredObject
from shared.bus.registry import WorkerRegistry
from shared.bus.replay import Replay
from shared.bus.services import ServiceDirectory

__all__ = ["Bus", "BusTimeout", "ConsumerState", "Disconnected", "KvBucket", "MalformedReply", "NatsCredentialsRefused",
           "NatsTlsFailed", "NatsUnavailable", "NatsUnreachable", "NoResponders", "ObjectBucket",
           "QueueMessage",
           "RemoteError", "Replay", "ServiceDirectory", "ServiceError", "StoredObject", "StreamState", "WorkQueue",
           "WorkerRegistry"]
