"""The one module that forms NATS subject, stream and bucket names, each paired with its payload.

Every name starts with ``<namespace>.v1.`` (``tandem.v1.`` by default). The namespace lets several
clusters, or several tests, share one nats-server without seeing each other's traffic.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Generic, TypeVar

from shared.protocol.admission import AdmissionDecision
from shared.protocol.base import WireModel
from shared.protocol.batch import BatchLineRequest
from shared.protocol.generate import CancelRequest, GenerateRequest, OriginAlive, OriginPing, TokenChunk
from shared.protocol.kv import KvEventBatch, KvMatchRequest, KvMatchResult
from shared.protocol.prefill import (KvFetchRequest, KvFetchResult, PrefillLeaseRequest, PrefillLeaseResult,
                                     RemotePrefillRequest)
from shared.protocol.workers import (ClusterStatusRequest, ClusterStatusResult, ControlRequest,
                                     ControlResult, Role, ScaleRequest, ScaleResult, WorkerLoad)

VERSION = "v1"
DEFAULT_NAMESPACE = "tandem"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

Req = TypeVar("Req", bound=WireModel)
Rep = TypeVar("Rep", bound=WireModel)


@dataclass(frozen=True)
class Endpoint(Generic[Req, Rep]):
    """A subject with the type sent on it and the type replied (``None``: publish, no reply)."""

    subject: str
    request_type: type[Req]
    reply_type: type[Rep] | None = None


def _token(value: str, what: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must match {_TOKEN.pattern} to be a subject token")
    return value


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# Priorities 0 and 1 have their own prefill-queue subjects; 2 and lower priorities share the last.
NUM_PREFILL_LEVELS = 3


def prefill_level(priority: int) -> int:
    """The prefill-queue level of a request priority (lower runs first)."""
    return min(max(priority, 0), NUM_PREFILL_LEVELS - 1)


class Subjects:
    def __init__(self, namespace: str = DEFAULT_NAMESPACE) -> None:
        self.namespace = _token(namespace, "namespace")
        self._root = f"{namespace}.{VERSION}"

    # --- request/reply and streams -------------------------------------------------------------
    def admission_submit(self) -> Endpoint[GenerateRequest, AdmissionDecision]:
        return Endpoint(f"{self._root}.admission.submit", GenerateRequest, AdmissionDecision)

    def decode_generate(self, worker_id: str) -> Endpoint[GenerateRequest, TokenChunk]:
        """Streamed replies: TokenChunk after TokenChunk to the request's reply subject."""
        return Endpoint(f"{self._root}.decode.{_token(worker_id, 'worker_id')}.generate",
                        GenerateRequest, TokenChunk)

    def decode_cancel(self, worker_id: str) -> Endpoint[CancelRequest, WireModel]:
        return Endpoint(f"{self._root}.decode.{_token(worker_id, 'worker_id')}.cancel", CancelRequest)

    def origin_alive(self, origin: str) -> Endpoint[OriginPing, OriginAlive]:
        """Served by each sender of ``GenerateRequest``s that sets their ``origin`` (each gateway):
        a worker asks it now and then, and aborts the requests of an origin nobody serves."""
        return Endpoint(f"{self._root}.origin.{_token(origin, 'origin')}.alive", OriginPing, OriginAlive)

    def kv_fetch(self, worker_id: str) -> Endpoint[KvFetchRequest, KvFetchResult]:
        """Another decode worker asks this one to write cached prefix blocks into its pool."""
        return Endpoint(f"{self._root}.decode.{_token(worker_id, 'worker_id')}.kv-fetch", KvFetchRequest,
                        KvFetchResult)

    def prefill_lease(self, decode_worker_id: str) -> Endpoint[PrefillLeaseRequest, PrefillLeaseResult]:
        """A prefill worker claims or renews its lease on a decode worker's reserved blocks."""
        return Endpoint(f"{self._root}.decode.{_token(decode_worker_id, 'worker_id')}.prefill-lease",
                        PrefillLeaseRequest, PrefillLeaseResult)

    def control(self, worker_id: str) -> Endpoint[ControlRequest, ControlResult]:
        return Endpoint(f"{self._root}.control.{_token(worker_id, 'worker_id')}",
                        ControlRequest, ControlResult)

    def kvindex_match(self) -> Endpoint[KvMatchRequest, KvMatchResult]:
        return Endpoint(f"{self._root}.kvindex.match", KvMatchRequest, KvMatchResult)

    def fleet_scale(self) -> Endpoint[ScaleRequest, ScaleResult]:
        """Served by ``tandem up --autoscale`` (the owner of the worker processes)."""
        return Endpoint(f"{self._root}.up.scale", ScaleRequest, ScaleResult)

    def cluster_status(self) -> Endpoint[ClusterStatusRequest, ClusterStatusResult]:
        return Endpoint(f"{self._root}.autoscaler.status", ClusterStatusRequest, ClusterStatusResult)

    def prefill_queue(self, priority: int = 0) -> Endpoint[RemotePrefillRequest, WireModel]:
        """The global prefill queue's subject for requests of ``priority``: JetStream stream
        ``prefill_stream``, one subject per level (``prefill_level``), each pulled by every prefill
        worker through that level's durable consumer ``prefill_consumer(priority)``."""
        return Endpoint(f"{self._root}.prefill.queue.p{prefill_level(priority)}", RemotePrefillRequest)

    def prefill_queue_all(self) -> Endpoint[RemotePrefillRequest, WireModel]:
        """Every level's subject (the stream's subject filter)."""
        return Endpoint(f"{self._root}.prefill.queue.*", RemotePrefillRequest)

    def batch_lines(self, batch_id: str) -> Endpoint[BatchLineRequest, WireModel]:
        """One batch's input lines, work items of stream ``batch_stream`` (one subject per batch,
        so a cancel purges exactly that batch's lines), pulled by every gateway's batch runner
        through the durable consumer ``batch_consumer``."""
        return Endpoint(f"{self._root}.batch.lines.{_token(batch_id, 'batch_id')}", BatchLineRequest)

    def batch_lines_all(self) -> Endpoint[BatchLineRequest, WireModel]:
        return Endpoint(f"{self._root}.batch.lines.*", BatchLineRequest)

    # --- publish-only ----------------------------------------------------------------------------
    def kv_events(self, worker_id: str) -> Endpoint[KvEventBatch, WireModel]:
        return Endpoint(f"{self._root}.kv.events.{_token(worker_id, 'worker_id')}", KvEventBatch)

    def kv_events_all(self) -> Endpoint[KvEventBatch, WireModel]:
        return Endpoint(f"{self._root}.kv.events.*", KvEventBatch)

    def load(self, role: Role, worker_id: str) -> Endpoint[WorkerLoad, WireModel]:
        return Endpoint(f"{self._root}.load.{_token(role, 'role')}.{_token(worker_id, 'worker_id')}",
                        WorkerLoad)

    def load_all(self) -> Endpoint[WorkerLoad, WireModel]:
        return Endpoint(f"{self._root}.load.*.*", WorkerLoad)

    # --- JetStream objects (names may not contain dots) -------------------------------------------
    @property
    def kv_events_stream(self) -> str:
        return f"{self.namespace.upper()}_KV_EVENTS"

    @property
    def prefill_stream(self) -> str:
        return f"{self.namespace.upper()}_PREFILL"

    def prefill_consumer(self, priority: int = 0) -> str:
        """The durable pull consumer of ``priority``'s level, shared by all prefill workers (a
        work-queue stream allows one consumer per subject)."""
        return f"prefill-workers-p{prefill_level(priority)}"

    def prefill_consumers(self) -> list[str]:
        """Every level's consumer, highest priority first."""
        return [self.prefill_consumer(level) for level in range(NUM_PREFILL_LEVELS)]

    @property
    def batch_stream(self) -> str:
        return f"{self.namespace.upper()}_BATCH"

    @property
    def batch_consumer(self) -> str:
        return "batch-runners"

    @property
    def batches_bucket(self) -> str:
        """KV: batch id → ``BatchRecord``."""
        return f"{self.namespace}-batches"

    @property
    def batch_results_bucket(self) -> str:
        """KV: ``batch_result_key`` → ``BatchLineResult`` (written once), plus a marker under
        ``batch_failure_key`` for each result that is not a 200 (so counts need no values)."""
        return f"{self.namespace}-batch-results"

    @property
    def files_bucket(self) -> str:
        """Object Store: file id → the uploaded bytes, its ``FileRecord`` as the description."""
        return f"{self.namespace}-files"

    @property
    def responses_bucket(self) -> str:
        """KV: ``response_key`` → ``StoredResponse`` (entries expire after the gateway's
        ``responses_ttl_s``, fixed when the bucket is created)."""
        return f"{self.namespace}-responses"

    @staticmethod
    def response_key(response_id: str) -> str:
        """Response ids come from URLs: anything but a subject token is refused (``ValueError``)."""
        return _token(response_id, "response_id")

    @property
    def conversations_bucket(self) -> str:
        """KV: ``conversation_key`` → ``StoredConversation``, ``conversation_item_key`` →
        ``StoredConversationItem``; no TTL (OpenAI keeps conversations until they are deleted)."""
        return f"{self.namespace}-conversations"

    @staticmethod
    def conversation_key(conversation_id: str) -> str:
        """Conversation ids come from URLs: anything but a subject token is refused (``ValueError``)."""
        return f"c.{_token(conversation_id, 'conversation_id')}"

    @staticmethod
    def conversation_item_key(conversation_id: str, item_id: str) -> str:
        """An item id is the client's to choose (any text): it enters the key as a digest."""
        return f"i.{_token(conversation_id, 'conversation_id')}.{_digest(item_id)}"

    @staticmethod
    def batch_result_key(batch_id: str, custom_id: str) -> str:
        """custom_id is any text: it enters the key as a digest (KV keys allow few characters)."""
        return f"{Subjects.batch_results_prefix(batch_id)}.{_digest(custom_id)}"

    @staticmethod
    def batch_failure_key(batch_id: str, custom_id: str) -> str:
        return f"{Subjects.batch_failures_prefix(batch_id)}.{_digest(custom_id)}"

    @staticmethod
    def batch_results_prefix(batch_id: str) -> str:
        return f"r.{_token(batch_id, 'batch_id')}"

    @staticmethod
    def batch_failures_prefix(batch_id: str) -> str:
        return f"f.{_token(batch_id, 'batch_id')}"

    @property
    def workers_bucket(self) -> str:
        return f"{self.namespace}-workers"

    @property
    def services_bucket(self) -> str:
        """Every service process's ``ServiceInfo`` (gateway, admission, kv-index, autoscaler and each
        worker: pid, restarts, metrics address), expiring without heartbeat (``shared.bus.services``)."""
        return f"{self.namespace}-services"

    @property
    def compile_bucket(self) -> str:
        """Object Store: artifact key → the compiled decode step (serialized, with its inductor cache),
        packed by the first worker that compiled it (``shared.engine.compiled.artifacts``)."""
        return f"{self.namespace}-compile"

    @property
    def nixl_bucket(self) -> str:
        """NIXL agent metadata per worker (KV bytes never travel over NATS, only this)."""
        return f"{self.namespace}-nixl"
