"""Admission's ``--routing round-robin`` on a real bus: the ready decode workers in turn, whatever
kv-index says they hold (the baseline that KV-aware routing is judged against in the replay)."""

from shared.bus import WorkerRegistry
from shared.protocol import GenerateRequest, KvMatchRequest, KvMatchResult, Subjects, WorkerOverlap

from services.admission.config import AdmissionSettings
from services.admission.service import AdmissionService
from test_admission_worker_leaves import worker


async def test_round_robin_admits_to_the_workers_in_turn_and_kv_routing_follows_the_prefix(bus, nats_url, namespace):
    subjects = Subjects(namespace)
    registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=5.0)
    for w in ("w1", "w2", "w3"):
        await registry.put(worker(subjects, w))

    async def match(_: KvMatchRequest) -> KvMatchResult:
        return KvMatchResult(overlaps=[WorkerOverlap(worker_id="w2", num_blocks=4)])

    await bus.serve(subjects.kvindex_match(), match)

    async def chosen(admission: AdmissionService, n: int) -> list[tuple[str, int]]:
        out = []
        for i in range(n):
            request = GenerateRequest(request_id=f"{admission._settings.routing}-{i}", model="m",
                                      prompt_token_ids=list(range(16)), block_hashes=[1, 2, 3, 4])
            decision = await admission.submit(request)
            assert decision.is_admitted, decision
            out.append((decision.worker_id, decision.num_overlap_blocks))
        return out

    in_turn = AdmissionService(AdmissionSettings(nats_url=nats_url, namespace=namespace, routing="round-robin"),
                               bus, registry)
    await in_turn.refresh()
    assert await chosen(in_turn, 4) == [("w1", 0), ("w2", 4), ("w3", 0), ("w1", 0)]
    by_prefix = AdmissionService(AdmissionSettings(nats_url=nats_url, namespace=namespace), bus, registry)
    await by_prefix.refresh()
    assert (await chosen(by_prefix, 1))[0][0] == "w2"
