"""Every wire model survives a JSON round trip; the wire stays tolerant and subjects stay formed."""

import pytest
from pydantic import ValidationError

from shared.protocol import (AdmissionDecision, AllBlocksClearedEvent, BlockRemovedEvent,
                             BlockStoredEvent, CancelRequest, ClusterStatusRequest,
                             ClusterStatusResult, ControlRequest, ControlResult, ErrorReply,
                             GenerateRequest, KvEventBatch, KvMatchRequest, KvMatchResult,
                             PrefillLeaseRequest, PrefillLeaseResult, PrefillNotification,
                             RemotePrefillRequest, SamplingParams, ScaleRequest, ScaleResult, ScalingAction,
                             ScalingDecisionRecord, ScalingStatus, Subjects,
                             TokenChunk, TokenLogprob, TopLogprob,
                             ServiceInfo, WorkerInfo, WorkerLoad, WorkerOverlap, WorkerStatus)

INFO = WorkerInfo(worker_id="decode-1", role="decode", model="smollm2-135m", block_size=16,
                  max_model_len=2048, num_blocks_total=100, max_num_seqs=8,
                  generate_subject="tandem.v1.decode.decode-1.generate",
                  cancel_subject="tandem.v1.decode.decode-1.cancel", pid=12, started_at=1.5)
LOAD = WorkerLoad(worker_id="decode-1", role="decode", seq=3, timestamp=2.0, num_running=1,
                  num_waiting=2, num_blocks_used=10, num_blocks_total=100, ttft_recent_s=0.01)

EXAMPLES = [
    SamplingParams(max_tokens=5, temperature=0.0, seed=7, stop_token_ids=[2], logprobs=3),
    GenerateRequest(request_id="r1", model="m", prompt_token_ids=[1, 2, 3],
                    sampling=SamplingParams(max_tokens=4), block_hashes=[2**63 - 1, 0]),
    TokenChunk(request_id="r1", index=0, token_ids=[5],
               logprobs=[TokenLogprob(token_id=5, logprob=-0.5,
                                      top=[TopLogprob(token_id=5, logprob=-0.5)])],
               finish_reason="length", num_prompt_tokens=3, worker_id="decode-1"),
    CancelRequest(request_id="r1"),
    AdmissionDecision(request_id="r1", is_admitted=True, worker_id="decode-1",
                      generate_subject="a.b", cancel_subject="a.c", num_overlap_blocks=2),
    AdmissionDecision(request_id="r1", is_admitted=False, reject_reason="overloaded",
                      retry_after_s=1.0, message="queues full"),
    KvEventBatch(worker_id="decode-1", events=[
        BlockStoredEvent(seq=1, timestamp=1.0, block_hashes=[1, 2], parent_hash=None),
        BlockRemovedEvent(seq=2, timestamp=1.0, block_hashes=[2]),
        AllBlocksClearedEvent(seq=3, timestamp=1.0)]),
    KvMatchRequest(block_hashes=[1, 2, 3]),
    KvMatchResult(overlaps=[WorkerOverlap(worker_id="decode-1", num_blocks=2)]),
    INFO,
    LOAD,
    ControlRequest(action="drain"),
    ControlResult(worker_id="decode-1", state="draining", num_in_flight=1),
    ClusterStatusRequest(),
    ClusterStatusResult(timestamp=3.0, workers=[WorkerStatus(info=INFO, load=LOAD, load_age_s=0.2)]),
    ServiceInfo(instance_id="admission-host.lan-42", service="admission", metrics_url="http://host:9100/metrics",
                host="host", pid=42, started_at=1.0, num_restarts=1),
    ControlRequest(action="flip", role="prefill"),
    ControlResult(worker_id="decode-1", state="draining", role="decode", flipping_to="prefill"),
    ClusterStatusResult(timestamp=3.0, scaling=ScalingStatus(enabled=True, last_reason="cooling down", recent=[
        ScalingDecisionRecord(timestamp=2.0, reason="prefill share 0.90 wanted, have 0.00", num_prefill=0,
                              num_decode=2, target_prefill=1, target_decode=1, prefill_tokens_per_s=900.0,
                              actions=[ScalingAction(kind="flip", worker_id="decode-1", role="prefill", ok=True)])])),
    ErrorReply(code="bad_request", message="bad", field="prompt_token_ids"),
    ControlRequest(action="stop", drain_timeout_s=300.0),
    ScaleRequest(action="start", role="decode", reason="utilisation 0.95"),
    ScaleRequest(action="stop", role="decode", worker_id="decode-2", reason="utilisation 0.10"),
    ScaleResult(worker_id="decode-3", pid=123),
    ScalingAction(kind="start", worker_id=None, role="decode", ok=False, message="no responders"),
    PrefillLeaseRequest(transfer_id="t1", request_id="r1", prefill_worker_id="prefill-1"),
    PrefillLeaseResult(transfer_id="t1", expires_at=12.5, lease_s=4.0),
    PrefillLeaseResult(transfer_id="t1"),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_json_round_trip(message):
    assert type(message).from_bytes(message.to_bytes()) == message


def test_a_flip_names_its_role_and_only_a_flip_does():
    with pytest.raises(ValidationError, match="role"):
        ControlRequest(action="flip")
    with pytest.raises(ValidationError, match="role"):
        ControlRequest(action="drain", role="decode")


def test_a_stop_names_its_worker_and_only_a_stop_does():
    with pytest.raises(ValidationError, match="worker_id"):
        ScaleRequest(action="stop", role="decode")
    with pytest.raises(ValidationError, match="worker_id"):
        ScaleRequest(action="start", role="decode", worker_id="decode-1")
    assert Subjects("ns").fleet_scale().subject == "ns.v1.up.scale"


def test_unknown_fields_are_ignored_and_models_are_frozen():
    data = b'{"request_id": "r", "reason": "x", "added_in_v1_1": 3}'
    msg = CancelRequest.from_bytes(data)
    assert msg == CancelRequest(request_id="r", reason="x")
    with pytest.raises(ValidationError):
        msg.request_id = "other"


@pytest.mark.parametrize("data", [
    b"not json",
    b'{"request_id": "r", "model": "m", "prompt_token_ids": []}',
    b'{"request_id": "r", "model": "m", "prompt_token_ids": ["a"]}',
    b'{"request_id": "r", "model": "m", "prompt_token_ids": [1], "sampling": {"max_tokens": 0}}',
    b'{"request_id": "r", "model": "m", "prompt_token_ids": [1], "block_hashes": [-1]}',
])
def test_malformed_generate_requests_are_rejected(data):
    with pytest.raises(ValidationError):
        GenerateRequest.from_bytes(data)


def test_kv_event_kinds_are_discriminated():
    batch = KvEventBatch.from_bytes(
        b'{"worker_id": "w", "events": [{"kind": "removed", "seq": 4, "timestamp": 0, '
        b'"block_hashes": [9]}]}')
    assert isinstance(batch.events[0], BlockRemovedEvent)


def test_subjects_are_versioned_and_typed():
    s = Subjects()
    ep = s.decode_generate("decode-1")
    assert ep.subject == "tandem.v1.decode.decode-1.generate"
    assert (ep.request_type, ep.reply_type) == (GenerateRequest, TokenChunk)
    assert s.admission_submit().subject == "tandem.v1.admission.submit"
    assert s.load("decode", "w").subject == "tandem.v1.load.decode.w"
    assert Subjects("t42").kv_events("w").subject == "t42.v1.kv.events.w"
    assert Subjects("t42").kv_events_stream == "T42_KV_EVENTS"
    assert Subjects("t42").workers_bucket == "t42-workers"


@pytest.mark.parametrize("bad", ["a.b", "a*", "", "a b", ">"])
def test_subject_tokens_are_validated(bad):
    with pytest.raises(ValueError):
        Subjects().decode_generate(bad)


# -- remote prefill ----------------------------------------------------------------------------------

def remote_prefill(**kw):
    fields = dict(request_id="r1", transfer_id="t" * 32, model="smollm2-135m", prompt_token_ids=list(range(40)),
                  decode_worker_id="decode-1", block_ids=[7, 3, 9], block_size=16, num_cached_tokens=16,
                  write_deadline=100.0, write_timeout_s=2.0)
    fields.update(kw)
    return RemotePrefillRequest(**fields)


def test_remote_prefill_request_round_trip_and_write_blocks():
    msg = remote_prefill(priority=2, created_at=97.5)
    assert RemotePrefillRequest.from_bytes(msg.to_bytes()) == msg
    # 40 tokens = 2 full blocks + a partial one; the first block is cached on the decode worker
    assert (msg.num_full_blocks, msg.first_block) == (2, 1)
    assert msg.write_block_ids == msg.block_ids[1:2] == [3]
    assert remote_prefill(num_cached_tokens=0).write_block_ids == [7, 3]
    exact = remote_prefill(prompt_token_ids=list(range(32)), block_ids=[7, 3], num_cached_tokens=0)
    assert exact.write_block_ids == [7, 3]  # a block-multiple prompt: every block is full
    assert remote_prefill(prompt_token_ids=list(range(10)), block_ids=[7], num_cached_tokens=0).write_block_ids == []


@pytest.mark.parametrize("bad", [
    dict(block_ids=[7, 3]),  # too few for 40 tokens
    dict(block_ids=[7, 3, 9, 1]),  # too many
    dict(block_ids=[]),
    dict(num_cached_tokens=8),  # not a block multiple
    dict(num_cached_tokens=40),  # the whole prompt: nothing left to compute
    dict(num_cached_tokens=48),
    dict(prompt_token_ids=list(range(32)), block_ids=[7, 3], num_cached_tokens=32),
    dict(num_cached_tokens=-16),
    dict(block_size=0),
    dict(prompt_token_ids=[]),
    dict(transfer_id=""),
    dict(write_timeout_s=0.0),
], ids=lambda d: ",".join(f"{k}={v!r}"[:24] for k, v in d.items()))
def test_remote_prefill_request_validation(bad):
    with pytest.raises(ValidationError):
        remote_prefill(**bad)


def test_remote_prefill_request_validation_applies_on_the_wire():
    data = remote_prefill().to_bytes().replace(b'"block_ids":[7,3,9]', b'"block_ids":[7,3]')
    assert data != remote_prefill().to_bytes()
    with pytest.raises(ValidationError):
        RemotePrefillRequest.from_bytes(data)


@pytest.mark.parametrize("note", [
    PrefillNotification(transfer_id="t1", request_id="r1", num_blocks=3, prefill_worker_id="prefill-1"),
    PrefillNotification(transfer_id="t1", request_id="r1", status="failed", message="out of KV blocks"),
], ids=["ok", "failed"])
def test_prefill_notification_round_trip(note):
    assert PrefillNotification.from_bytes(note.to_bytes()) == note


@pytest.mark.parametrize("data", [
    b"",
    b'{"request_id": "r1"}',  # no transfer id
    b'{"transfer_id": "t1", "request_id": "r1", "status": "maybe"}',
    b'{"transfer_id": "t1", "request_id": "r1", "num_blocks": -1}',
])
def test_malformed_prefill_notifications_are_rejected(data):
    with pytest.raises(ValidationError):
        PrefillNotification.from_bytes(data)
