"""tandem up's fleet manager over a real nats-server, with a stand-in for the stack (no worker
processes): a start asks the stack for a worker and answers with its id, a stop marks the worker
retired and sends it a stop with the long drain timeout, and a stop nobody hears leaves the worker
supervised."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from services.stack.fleet import FleetManager
from shared.bus import RemoteError
from shared.protocol import ControlRequest, ControlResult, ScaleRequest, Subjects


class StandInStack:
    def __init__(self, nats_url: str, namespace: str) -> None:
        self.spec = SimpleNamespace(namespace=namespace)
        self.nats_url = nats_url
        self.nats_ca, self.nats_replicas = None, None  # a single server without TLS
        self.names = {f"{namespace}-decode-1": "decode-1"}
        self.retired: set[str] = set()
        self.lines: list[str] = []

    def add_worker(self, role: str):
        name = f"{role}-{len(self.names) + 1}"
        self.names[f"{self.spec.namespace}-{name}"] = name
        return name, f"{self.spec.namespace}-{name}", SimpleNamespace(pid=4242)

    def worker_name(self, worker_id: str) -> str | None:
        return self.names.get(worker_id)

    def retire(self, name: str, is_retired: bool = True) -> None:
        (self.retired.add if is_retired else self.retired.discard)(name)

    def log_line(self, line: str) -> None:
        self.lines.append(line)


@pytest.fixture
async def fleet(nats_url, namespace):
    stack = StandInStack(nats_url, namespace)
    manager = FleetManager(stack, drain_timeout_s=300.0)
    await asyncio.to_thread(manager.start)
    yield stack
    await asyncio.to_thread(manager.stop)


async def test_a_start_asks_the_stack_for_a_worker_of_the_role(bus, namespace, fleet):
    s = Subjects(namespace)
    result = await bus.request(s.fleet_scale(), ScaleRequest(action="start", role="decode", reason="busy"),
                               timeout_s=10)
    assert (result.worker_id, result.pid) == (f"{namespace}-decode-2", 4242)
    assert fleet.lines == ["scale up: started decode-2 (decode, pid 4242): busy"]


async def test_a_stop_retires_the_worker_and_asks_it_to_drain_with_the_long_timeout(bus, namespace, fleet):
    s = Subjects(namespace)
    worker_id = f"{namespace}-decode-1"
    asked: list[ControlRequest] = []

    async def control(request: ControlRequest) -> ControlResult:
        asked.append(request)
        return ControlResult(worker_id=worker_id, state="draining")

    await bus.serve(s.control(worker_id), control)
    await bus.flush()
    result = await bus.request(s.fleet_scale(), ScaleRequest(action="stop", role="decode", worker_id=worker_id,
                                                             reason="idle"), timeout_s=10)
    assert result.worker_id == worker_id and fleet.retired == {"decode-1"}
    assert [(a.action, a.drain_timeout_s) for a in asked] == [("stop", 300.0)]
    assert fleet.lines == ["scale down: decode-1 draining, then exiting: idle"]


async def test_a_stop_the_worker_does_not_hear_leaves_it_in_the_fleet(bus, namespace, fleet):
    s = Subjects(namespace)
    with pytest.raises(RemoteError, match="nobody serves") as err:
        await bus.request(s.fleet_scale(), ScaleRequest(action="stop", role="decode",
                                                        worker_id=f"{namespace}-decode-1"), timeout_s=20)
    assert err.value.code == "not_found" and fleet.retired == set()
    with pytest.raises(RemoteError, match="no worker") as err:
        await bus.request(s.fleet_scale(), ScaleRequest(action="stop", role="decode", worker_id="elsewhere"),
                          timeout_s=10)
    assert err.value.code == "not_found"
