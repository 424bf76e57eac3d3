"""docs/protocol/: the checked-in JSON Schemas and hash vectors match the code (a change to a wire
model without `tandem protocol` fails here), the vectors follow the byte layout docs/protocol.md
states (computed here with hashlib alone, as another language would), and block hashes sent as
decimal strings (JavaScript's way to keep 63 bits) parse to the same numbers."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from services.cli import main as tandem
from shared.kvcache.hashing import hash_blocks, make_namespace
from shared.protocol import GenerateRequest, KvEventBatch, TokenChunk
from shared.protocol import spec
from shared.protocol.base import WireModel

DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocol"


def test_checked_in_schemas_and_vectors_match_the_code():
    assert spec.drift(DOCS) == [], "run `tandem protocol` and commit docs/protocol/"


def test_drift_is_found_and_named(tmp_path, capsys):
    assert tandem(["protocol", "--out", str(tmp_path)]) == 0
    assert tandem(["protocol", "--out", str(tmp_path), "--check"]) == 0
    schema = tmp_path / "schemas" / "TokenChunk.json"
    edited = json.loads(schema.read_text())
    edited["properties"]["finish_reason"]["anyOf"][0]["enum"].append("eos")  # as if the model had changed
    schema.write_text(json.dumps(edited))
    (tmp_path / "schemas" / "Gone.json").write_text("{}")
    capsys.readouterr()
    assert tandem(["protocol", "--out", str(tmp_path), "--check"]) == 1
    out = capsys.readouterr().out
    assert "TokenChunk.json" in out and "Gone.json" in out and "GenerateRequest" not in out


def test_every_wire_model_sent_alone_has_a_schema():
    nested = {"SamplingParams", "GrammarSpec", "TextMessage", "TopLogprob", "TokenLogprob", "BlockStoredEvent",
              "BlockRemovedEvent", "AllBlocksClearedEvent", "WorkerOverlap", "PrefillQueueStatus",
              "WorkerStatus", "ScalingAction", "ScalingDecisionRecord", "ScalingStatus", "KvTierLoad", "KvFetchLoad", "KvSource",
              "BatchLineError", "RequestCounts"}
    models = {cls.__name__ for cls in _subclasses(WireModel)} - {"StatusPage", "GatewayState"}
    assert models - nested == {m.__name__ for m in spec.MESSAGES}
    assert all(name in json.dumps(spec.json_schemas()) for name in nested)


def _subclasses(cls):
    import shared.protocol  # noqa: F401 — every wire module imported

    for sub in cls.__subclasses__():
        if sub.__module__.startswith("shared.protocol"):
            yield sub
        yield from _subclasses(sub)


def _spec_hash(parent: int, namespace: bytes, token_ids: list[int]) -> int:
    """docs/protocol.md's layout: blake2b with an 8-byte digest over parent (u64 LE), namespace
    length (u32 LE), namespace, each token id (u32 LE); the digest read as u64 LE, top bit cleared."""
    data = struct.pack("<Q", parent) + struct.pack("<I", len(namespace)) + namespace
    data += b"".join(struct.pack("<I", t) for t in token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def test_hash_vectors_follow_the_documented_layout_and_equal_the_engines():
    vectors = json.loads((DOCS / "hash_vectors.json").read_text())
    assert len(vectors) >= 3
    for v in vectors:
        namespace = bytes.fromhex(v["namespace_hex"])
        assert namespace == make_namespace(v["model"]) == (v["model"] + "\x1f\x1f").encode()
        n = v["block_size"]
        parent, expected = 0, []
        for i in range(len(v["token_ids"]) // n):
            parent = _spec_hash(parent, namespace, v["token_ids"][i * n:(i + 1) * n])
            expected.append(str(parent))
        assert v["block_hashes"] == expected
        assert [str(h) for h in hash_blocks(v["token_ids"], n, namespace)] == expected


def test_block_hashes_as_decimal_strings_parse_to_the_same_numbers():
    big = 2**63 - 1  # not exact as a double: 9223372036854775807 → 9223372036854775808.0
    batch = KvEventBatch.model_validate_json(json.dumps(
        {"worker_id": "js-1", "events": [{"kind": "stored", "seq": 1, "timestamp": 1.5,
                                          "block_hashes": [str(big), "5"], "parent_hash": "7"}]}))
    assert batch.events[0].block_hashes == [big, 5] and batch.events[0].parent_hash == 7
    request = GenerateRequest.model_validate_json(json.dumps(
        {"request_id": "r", "model": "m", "prompt_token_ids": [1], "block_hashes": [str(big)]}))
    assert request.block_hashes == [big]


def test_an_unknown_finish_reason_is_refused_by_the_schema_and_the_model():
    schema = spec.json_schemas()["TokenChunk"]
    assert schema["properties"]["finish_reason"]["anyOf"][0]["enum"] == ["stop", "length", "abort"]
    assert set(schema["required"]) == {"request_id", "index"}
    import pydantic
    import pytest

    with pytest.raises(pydantic.ValidationError):
        TokenChunk.model_validate_json('{"request_id": "r", "index": 0, "finish_reason": "eos"}')
