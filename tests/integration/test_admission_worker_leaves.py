"""Admission on a real bus when the worker it would pick leaves the registry while it waits for
kv-index (the fault drill's SIGKILL of a decode worker did this: the migrated requests of the dead
worker were routed by a stale list of workers and admission failed with an AttributeError, which
the gateway passed on as ``admission_unavailable``)."""

from shared.bus import WorkerRegistry
from shared.protocol import GenerateRequest, KvMatchRequest, KvMatchResult, Subjects, WorkerInfo, WorkerOverlap

from services.admission.config import AdmissionSettings
from services.admission.service import AdmissionService


def worker(subjects: Subjects, worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="decode", model="m", block_size=4, max_model_len=256,
                      generate_subject=subjects.decode_generate(worker_id).subject,
                      cancel_subject=subjects.decode_cancel(worker_id).subject)


async def test_a_worker_that_leaves_while_kv_index_answers_is_not_chosen(bus, nats_url, namespace):
    subjects = Subjects(namespace)
    registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=5.0)
    for w in ("w1", "w2"):
        await registry.put(worker(subjects, w))
    admission = AdmissionService(AdmissionSettings(nats_url=nats_url, namespace=namespace), bus, registry)
    await admission.start()

    async def match(_: KvMatchRequest) -> KvMatchResult:
        # w1 holds the prefix, and leaves (a registry refresh drops it) before kv-index's answer arrives
        admission.view.set_workers([worker(subjects, "w2")])
        return KvMatchResult(overlaps=[WorkerOverlap(worker_id="w1", num_blocks=4)])

    await bus.serve(subjects.kvindex_match(), match)
    request = GenerateRequest(request_id="r1", model="m", prompt_token_ids=list(range(16)),
                              block_hashes=[1, 2, 3, 4])
    decision = await bus.request(subjects.admission_submit(), request, timeout_s=5)
    assert (decision.is_admitted, decision.worker_id) == (True, "w2")
