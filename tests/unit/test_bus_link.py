"""The bus's view of its connection (``shared.bus.link``), driven by hand: no server needed."""

import asyncio

from shared.bus.link import Link


async def test_a_disconnect_tells_each_open_listener_once_and_forgets_them():
    link = Link("t")
    heard: list[str] = []
    link.on_loss(lambda: heard.append("a"))
    stop_b = link.on_loss(lambda: heard.append("b"))
    stop_b()  # a stream that ended before the disconnect
    link.disconnected()
    link.disconnected()  # a listener hears one loss: its stream has ended by then
    assert heard == ["a"] and link.num_disconnects == 2


async def test_resume_hooks_run_after_each_reconnect_and_retry_until_they_succeed():
    link = Link("t")
    calls: list[int] = []
    done = asyncio.Event()

    async def resume() -> None:
        calls.append(len(calls))
        if len(calls) < 3:
            raise RuntimeError("JetStream not ready")
        done.set()

    link.on_resume("replay", resume)
    link.reconnected()
    await asyncio.wait_for(done.wait(), 5)
    assert calls == [0, 1, 2]


async def test_a_disconnect_cancels_a_resume_in_progress_and_removed_hooks_do_not_run():
    link = Link("t")
    started, cancelled, never = asyncio.Event(), asyncio.Event(), asyncio.Event()
    ran: list[str] = []

    async def slow() -> None:
        started.set()
        try:
            await never.wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        ran.append("slow finished")

    async def gone() -> None:
        ran.append("gone")

    link.on_resume("slow", slow)
    remove = link.on_resume("gone", gone)
    remove()
    link.reconnected()
    await asyncio.wait_for(started.wait(), 5)
    link.disconnected()  # the connection dropped again: the resume starts over at the next reconnect
    await asyncio.wait_for(cancelled.wait(), 5)
    assert ran == []


def test_a_replicated_stream_is_used_only_once_it_has_a_leader():
    """On a cluster a new stream (or bucket) elects its leader a moment after creation; a write
    before that gets no response. The bus waits for the leader, and goes on after its timeout."""
    import asyncio
    from types import SimpleNamespace

    import nats.errors

    from shared.bus.bus import Bus

    class JetStream:
        def __init__(self, answers):
            self.answers, self.asked = list(answers), 0

        async def stream_info(self, stream):
            self.asked += 1
            answer = self.answers.pop(0) if self.answers else None
            if isinstance(answer, Exception):
                raise answer
            return SimpleNamespace(cluster=SimpleNamespace(leader=answer))

    def bus(js, replicas):
        return Bus(SimpleNamespace(jetstream=lambda: js), "t", replicas=replicas)

    electing = JetStream([nats.errors.TimeoutError(), None, "nats-2"])
    asyncio.run(bus(electing, 3)._wait_for_leader("S"))
    assert electing.asked == 3
    single = JetStream([])
    asyncio.run(bus(single, 1)._wait_for_leader("S"))
    assert single.asked == 0  # one server: nothing to elect
    never = JetStream([None] * 1000)
    asyncio.run(bus(never, 3)._wait_for_leader("S", timeout_s=0.3))
    assert 2 <= never.asked < 1000
