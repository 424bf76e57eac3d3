"""The protocol's machine-readable half: a JSON Schema for every top-level message and test vectors
for the block hash, written to ``docs/protocol/`` by ``tandem protocol`` and checked against the
code by the tests (``tandem protocol --check`` fails when they drift). ``docs/protocol.md`` is the
prose half.

The schemas are pydantic's validation schemas: what a Tandem consumer accepts. Integers there are
also accepted as decimal strings (pydantic's lax mode), which is how a producer whose JSON numbers
are doubles (JavaScript) sends a 63-bit block hash without losing bits.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.kvcache.hashing import hash_blocks, make_namespace
from shared.protocol.admission import AdmissionDecision
from shared.protocol.base import WireModel
from shared.protocol.batch import BatchLineRequest, BatchLineResult, BatchRecord, FileRecord
from shared.protocol.conversations import StoredConversation, StoredConversationItem
from shared.protocol.errors import ErrorReply
from shared.protocol.generate import CancelRequest, GenerateRequest, OriginAlive, OriginPing, TokenChunk
from shared.protocol.kv import KvEventBatch, KvMatchRequest, KvMatchResult
from shared.protocol.responses import StoredResponse
from shared.protocol.prefill import (KvFetchRequest, KvFetchResult, PrefillLeaseRequest, PrefillLeaseResult, PrefillNotification,
                                     RemotePrefillRequest)
from shared.protocol.workers import (ClusterStatusRequest, ClusterStatusResult, ControlRequest, ControlResult,
                                     ScaleRequest, ScaleResult, ServiceInfo, WorkerInfo, WorkerLoad)

# Every message sent on its own (nested types appear inside these schemas under "$defs").
MESSAGES: tuple[type[WireModel], ...] = (
    GenerateRequest, TokenChunk, CancelRequest, OriginPing, OriginAlive, ErrorReply, AdmissionDecision, WorkerInfo, WorkerLoad,
    ControlRequest, ControlResult, ServiceInfo, KvEventBatch, KvMatchRequest, KvMatchResult,
    RemotePrefillRequest, PrefillNotification, PrefillLeaseRequest, PrefillLeaseResult, KvFetchRequest, KvFetchResult,
    ClusterStatusRequest, ClusterStatusResult, ScaleRequest, ScaleResult,
    FileRecord, BatchRecord, BatchLineRequest, BatchLineResult, StoredResponse, StoredConversation,
    StoredConversationItem)

# (model id, block size, token ids): short and long prompts, a partial last block, two namespaces.
_VECTOR_CASES = (
    ("smollm2-135m", 4, list(range(1, 11))),
    ("smollm2-135m", 16, [1, 9690, 314, 253, 1234, 2, 49151, 0, 7, 7, 7, 7, 42, 100, 3000, 5] * 3),
    ("other-model", 4, list(range(1, 11))),
)


def json_schemas() -> dict[str, dict]:
    """Message name → its JSON Schema (draft 2020-12, as pydantic writes it)."""
    return {model.__name__: model.model_json_schema() for model in MESSAGES}


def hash_vectors() -> list[dict]:
    """Inputs and expected block hashes (decimal strings: exact in any language's JSON)."""
    vectors = []
    for model_id, block_size, token_ids in _VECTOR_CASES:
        namespace = make_namespace(model_id)
        vectors.append({"model": model_id, "namespace_hex": namespace.hex(), "block_size": block_size,
                        "token_ids": token_ids,
                        "block_hashes": [str(h) for h in hash_blocks(token_ids, block_size, namespace)]})
    return vectors


def render() -> dict[str, str]:
    """Relative path → file text of everything ``tandem protocol`` writes."""
    files = {f"schemas/{name}.json": _dump(schema) for name, schema in json_schemas().items()}
    files["hash_vectors.json"] = _dump(hash_vectors())
    return files


def write(out: Path) -> list[Path]:
    written = []
    for relative, text in render().items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def drift(out: Path) -> list[str]:
    """Files under ``out`` that differ from what the code generates (missing ones included), and
    schema files there that no message produces any more."""
    expected = render()
    stale = [str(p.relative_to(out)) for p in sorted((out / "schemas").glob("*.json"))
             if str(p.relative_to(out)) not in expected]
    changed = [rel for rel, text in expected.items() if not (out / rel).is_file() or (out / rel).read_text() != text]
    return changed + stale


def _dump(value: object) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"
