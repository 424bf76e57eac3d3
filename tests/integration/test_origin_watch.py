"""``OriginWatch`` on a real nats-server: the requests of a sender that left the bus are aborted
after the grace period, and only theirs; a sender that is there but slow to answer (a timeout says
nothing) keeps its requests."""

from __future__ import annotations

import asyncio

from services.stack.waiting import wait_until
from services.worker.origins import OriginWatch
from shared.bus import Bus, BusTimeout, NoResponders
from shared.protocol import GenerateRequest, OriginAlive, OriginPing, Subjects


def request(request_id: str, origin: str | None) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, model="m", prompt_token_ids=[1, 2, 3], origin=origin)


async def serve_origin(nats_url: str, subjects: Subjects, origin: str, *, delay_s: float = 0.0) -> Bus:
    bus = await Bus.connect(nats_url, origin)

    async def alive(ping: OriginPing) -> OriginAlive:
        await asyncio.sleep(delay_s)
        return OriginAlive(origin=origin)

    await bus.serve(subjects.origin_alive(origin), alive)
    await bus.flush()
    return bus


async def answers(bus: Bus, subjects: Subjects, origin: str) -> None:
    """Wait until ``origin`` answers this bus: the watch's next round must not see "no responders"
    from a subscription the server has not made visible yet."""
    async def answered() -> bool:
        try:
            await bus.request(subjects.origin_alive(origin), OriginPing(worker_id="probe", num_requests=0),
                              timeout_s=2.0)
        except (NoResponders, BusTimeout):
            return False
        return True

    await wait_until(answered, timeout_s=10, what=f"{origin} answering")


async def test_requests_of_a_gone_origin_are_aborted_after_the_grace(bus, nats_url, namespace):
    subjects = Subjects(namespace)
    aborted: list[tuple[str, str]] = []

    async def abort(request_id: str, reason: str) -> None:
        aborted.append((request_id, reason))

    watch = OriginWatch(bus, subjects, "w1", abort, grace_s=1.0, timeout_s=2.0)
    stays = await serve_origin(nats_url, subjects, "gw-stays")
    leaves = await serve_origin(nats_url, subjects, "gw-leaves")
    for r in (request("a", "gw-stays"), request("b", "gw-leaves"), request("c", "gw-leaves"), request("d", None)):
        watch.add(r)
    watch.remove(request("c", "gw-leaves"))  # finished before its gateway left
    try:
        assert await watch.check(now=100.0) == []
        await leaves.close()
        assert await watch.check(now=101.0) == []       # first "no responders": the grace starts
        assert await watch.check(now=101.5) == []       # still within it
        assert await watch.check(now=102.0) == ["b"]    # a whole grace unanswered
        assert aborted == [("b", "origin gw-leaves is gone")] and watch.num_aborted == 1
        assert await watch.check(now=110.0) == []       # nothing left of that origin; gw-stays answers
    finally:
        await stays.close()


async def test_an_origin_that_answers_late_or_comes_back_keeps_its_requests(bus, nats_url, namespace):
    subjects = Subjects(namespace)
    aborted: list[str] = []

    async def abort(request_id: str, reason: str) -> None:
        aborted.append(request_id)

    watch = OriginWatch(bus, subjects, "w1", abort, grace_s=1.0, timeout_s=0.2)
    slow = await serve_origin(nats_url, subjects, "gw-slow", delay_s=1.0)
    watch.add(request("s", "gw-slow"))
    watch.add(request("r", "gw-back"))
    try:
        assert await watch.check(now=0.0) == []    # gw-slow times out; gw-back: no responders
        back = await serve_origin(nats_url, subjects, "gw-back")
        await answers(bus, subjects, "gw-back")
        assert await watch.check(now=0.6) == []    # it answers: the grace is over
        await back.close()
        assert await watch.check(now=1.2) == []    # gone again: a new grace starts here
        assert await watch.check(now=2.0) == []
        assert await watch.check(now=5.0) == ["r"]
        assert aborted == ["r"]                     # gw-slow never answered in time, never aborted
    finally:
        await slow.close()
