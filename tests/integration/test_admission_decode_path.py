"""A request moved from a worker that ran it compiled (``sampling.decode_path``) is admitted to a
worker whose decode step is compiled, where there is one: on one still compiling it would run
eagerly, and its tokens could differ from those it would have had without moving."""

import itertools
import time

from shared.bus import WorkerRegistry
from shared.protocol import GenerateRequest, SamplingParams, Subjects, WorkerLoad

from services.admission.config import AdmissionSettings
from services.admission.service import AdmissionService
from test_admission_worker_leaves import worker


async def test_a_request_moved_from_a_compiled_worker_goes_to_a_compiled_one(bus, nats_url, namespace):
    subjects = Subjects(namespace)
    registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=5.0)
    for w in ("w1", "w2", "w3"):
        await registry.put(worker(subjects, w))
    admission = AdmissionService(AdmissionSettings(nats_url=nats_url, namespace=namespace, routing="round-robin"),
                                 bus, registry)
    await admission.refresh()

    seq = itertools.count(1)

    def report(steps: dict[str, str]) -> None:  # the workers' load reports, as admission receives them
        for w, step in steps.items():
            admission.view.update_load(WorkerLoad(worker_id=w, role="decode", seq=next(seq),
                                                  timestamp=time.time(), decode_step=step), time.monotonic())

    async def chosen(n: int, decode_path: str | None) -> list[str]:
        out = []
        for i in range(n):
            request = GenerateRequest(request_id=f"{decode_path}-{i}-m1", model="m", prompt_token_ids=list(range(16)),
                                      sampling=SamplingParams(num_output_in_prompt=4, decode_path=decode_path))
            decision = await admission.submit(request)
            assert decision.is_admitted, decision
            out.append(decision.worker_id)
        return out

    report({"w1": "compiling", "w2": "compiled", "w3": "eager"})
    assert await chosen(3, "compiled") == ["w2"] * 3
    assert sorted(await chosen(3, "eager")) == ["w1", "w2", "w3"]  # an eager path runs anywhere
    assert sorted(await chosen(3, None)) == ["w1", "w2", "w3"]
    report({"w1": "compiling", "w2": "compiling", "w3": "eager"})  # no compiled worker: any of them
    assert sorted(await chosen(3, "compiled")) == ["w1", "w2", "w3"]
