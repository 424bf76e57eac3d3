"""Wire types (pydantic v2, JSON) and the one module forming subject names (``subjects``)."""

from shared.protocol.admission import AdmissionDecision
from shared.protocol.base import WireModel
from shared.protocol.batch import (BatchLineError, BatchLineRequest, BatchLineResult, BatchRecord, FileRecord,
                                   RequestCounts)
from shared.protocol.conversations import StoredConversation, StoredConversationItem
from shared.protocol.errors import ErrorReply
from shared.protocol.generate import (CancelRequest, GenerateRequest, GrammarSpec, OriginAlive, OriginPing,
                                      SamplingParams, TokenChunk, TokenLogprob, TopLogprob)
from shared.protocol.kv import (AllBlocksClearedEvent, BlockRemovedEvent, BlockStoredEvent,
                                KvEventBatch, KvMatchRequest, KvMatchResult, WorkerOverlap)
from shared.protocol.prefill import (KvFetchRequest, KvFetchResult, KvSource, PrefillLeaseRequest, PrefillLeaseResult, PrefillNotification,
                                     PrefillQueueStatus, RemotePrefillRequest)
from shared.protocol.responses import StoredResponse
from shared.protocol.subjects import Endpoint, Subjects
from shared.protocol.workers import (ClusterStatusRequest, ClusterStatusResult, ControlRequest,
                                     ControlResult, ScaleRequest, ScaleResult, ScalingAction, ScalingDecisionRecord,
                                     ScalingStatus, ServiceInfo, WorkerInfo, WorkerLoad, WorkerStatus)

__all__ = [
    "AdmissionDecision", "AllBlocksClearedEvent", "BatchLineError", "BatchLineRequest", "BatchLineResult",
    "BatchRecord", "FileRecord", "RequestCounts", "BlockRemovedEvent", "BlockStoredEvent",
    "CancelRequest", "ClusterStatusRequest", "ClusterStatusResult", "ControlRequest",
    "ControlResult", "Endpoint", "ErrorReply", "GenerateRequest", "KvEventBatch", "KvMatchRequest",
    "KvFetchRequest", "KvFetchResult", "KvMatchResult", "KvSource", "OriginAlive", "OriginPing", "PrefillLeaseRequest", "PrefillLeaseResult", "PrefillNotification", "PrefillQueueStatus",
    "RemotePrefillRequest", "SamplingParams", "GrammarSpec", "ScaleRequest", "ScaleResult", "ScalingAction",
    "ScalingDecisionRecord", "ScalingStatus", "ServiceInfo", "StoredConversation", "StoredConversationItem",
    "StoredResponse", "Subjects", "TokenChunk", "TokenLogprob", "TopLogprob",
    "WireModel", "WorkerInfo", "WorkerLoad", "WorkerOverlap", "WorkerStatus",
]
