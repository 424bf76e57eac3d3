"""Every wire model survives a JSON round trip; the wire stays tolerant and subjects stay formed."""

import pytest
from pydantic import ValidationError

from shared.protocol import (AdmissionDecision, AllBlocksClearedEvent, BlockRemovedEvent,
                             BlockStoredEvent, CancelRequest, ClusterStatusRequest,
                             ClusterStatusResult, ControlRequest, ControlResult, ErrorReply,
                             GenerateRequest, KvEventBatch, KvMatchRequest, KvMatchResult,
                             SamplingParams, Subjects, TokenChunk, TokenLogprob, TopLogprob,
                             WorkerInfo, WorkerLoad, WorkerOverlap, WorkerStatus)

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
    ErrorReply(code="bad_request", message="bad", field="prompt_token_ids"),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_json_round_trip(message):
    assert type(message).from_bytes(message.to_bytes()) == message


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
