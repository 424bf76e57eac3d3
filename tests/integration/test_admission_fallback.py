"""Admission on a real bus when the worker holding a prompt's prefix would serve it too late: it is
admitted on the next cheapest worker that meets its SLO (told to fetch the prefix from the holder),
and rejected, shedding the lower tiers, only when every worker would miss (``--fallback-workers``)."""

import itertools
import time

from shared.bus import WorkerRegistry
from shared.protocol import GenerateRequest, KvMatchRequest, KvMatchResult, Subjects, WorkerLoad, WorkerOverlap

from services.admission.config import AdmissionSettings
from services.admission.service import AdmissionService
from test_admission_worker_leaves import worker

QOS = "default_tier: batch\ntiers:\n  premium: {priority: 0, ttft_slo_ms: 1000}\n  batch: {priority: 2}\n"


async def test_a_request_the_holder_would_serve_late_goes_to_another_worker_in_time(bus, nats_url, namespace,
                                                                                   tmp_path):
    subjects = Subjects(namespace)
    registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=5.0)
    for w in ("w1", "w2"):
        await registry.put(worker(subjects, w))

    async def match(_: KvMatchRequest) -> KvMatchResult:  # w1 holds all four blocks of every prompt
        return KvMatchResult(overlaps=[WorkerOverlap(worker_id="w1", num_blocks=4)])

    await bus.serve(subjects.kvindex_match(), match)
    qos = tmp_path / "qos.yaml"
    qos.write_text(QOS)

    async def admission_with(fallback_workers: int) -> AdmissionService:
        admission = AdmissionService(AdmissionSettings(nats_url=nats_url, namespace=namespace, qos=str(qos),
                                                       fallback_workers=fallback_workers, arrival_margin_sd=0.0),
                                     bus, registry)
        await admission.refresh()
        return admission

    seq = itertools.count(1)

    def report(admission: AdmissionService, queued: dict[str, int]) -> None:
        # 100 prompt tokens per second on each, ``queued`` premium prompt tokens waiting
        for w in ("w1", "w2"):
            admission.view.update_load(WorkerLoad(
                worker_id=w, role="decode", seq=next(seq), timestamp=time.time(), prefill_tokens_per_s=100.0,
                queued_prefill_tokens={0: queued.get(w, 0)}), time.monotonic())

    def premium(request_id: str) -> GenerateRequest:
        return GenerateRequest(request_id=request_id, model="m", tier="premium", prompt_token_ids=list(range(16)),
                               block_hashes=[1, 2, 3, 4])

    def batch(request_id: str) -> GenerateRequest:
        return premium(request_id).model_copy(update={"tier": "batch"})

    admission = await admission_with(fallback_workers=3)
    report(admission, {})
    first = await admission.submit(premium("p1"))   # both idle: the holder, nothing to prefill
    assert (first.is_admitted, first.worker_id, first.num_overlap_blocks) == (True, "w1", 4), first
    report(admission, {"w1": 300})   # 3 s of premium prompts ahead on the holder: over the 1 s SLO
    moved = await admission.submit(premium("p2"))
    assert (moved.is_admitted, moved.worker_id, moved.num_overlap_blocks) == (True, "w2", 0), moved
    assert moved.predicted_ttft_s < 1.0                       # its 16 tokens at 100 tok/s on w2
    assert moved.kv_source is not None and moved.kv_source.worker_id == "w1"   # it may fetch them from w1
    assert admission.metrics.admitted_elsewhere._value.get() == 1
    assert (await admission.submit(batch("b1"))).is_admitted   # no miss: the lower tier is not shed

    # without fallback workers, the same request is rejected on the holder, and the batch tier is shed
    strict = await admission_with(fallback_workers=0)
    report(strict, {"w1": 300})
    rejected = await strict.submit(premium("p3"))
    assert (rejected.is_admitted, rejected.reject_reason) == (False, "slo"), rejected
    assert "predicted TTFT 3.01s > premium SLO 1.00s" in rejected.message
    shed = await strict.submit(batch("b2"))
    assert (shed.is_admitted, shed.reject_reason) == (False, "shedding"), shed

    # every worker too late: rejected with the holder's prediction
    report(admission, {"w1": 300, "w2": 500})
    everywhere = await admission.submit(premium("p4"))
    assert (everywhere.is_admitted, everywhere.reject_reason) == (False, "slo"), everywhere
    assert "predicted TTFT 3.01s" in everywhere.message
