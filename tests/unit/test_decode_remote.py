"""The decode worker's remote-prefill bookkeeping (shared.disagg.RemotePrefills) with a fake
engine and a fake clock: no sockets, no model. What a reservation puts in its queue message, how
NIXL notifications (right, repeated, unknown, malformed), cancellations, a failed publish and the
end of the window resolve a waiting request, and when the blocks go back to the pool."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from shared.disagg import CLOCK_MARGIN_S, QUEUE_STATE_MAX_AGE_S, RemotePrefills
from shared.engine import EngineOutput, SamplingParams
from shared.engine.engine import RemotePrefillSlot
from shared.policy.disagg import DisaggConfig
from shared.protocol import GenerateRequest, PrefillLeaseRequest, PrefillNotification, RemotePrefillRequest

MODEL = "smollm2-135m"
BLOCK = 16
PROMPT = list(range(1, 101))  # 100 tokens: 6 full blocks and a partial one
TIMEOUT_S, WRITE_TIMEOUT_S = 30.0, 5.0
NOW = 1_000_000.0  # the fake clock: every time below is NOW + something


class FakeEngine:
    """An AsyncEngine's remote-prefill surface: records what the bookkeeping asks of it."""

    block_size = BLOCK

    def __init__(self, *, num_cached: int = 0, pool_full: bool = False) -> None:
        self.num_cached = num_cached
        self.pool_full = pool_full
        self.reserved: list[dict] = []
        self.decided: list[bool] = []
        self.calls: list[tuple] = []
        self.outputs: dict[str, list[EngineOutput]] = {}

    async def reserve_remote_prefill(self, request_id, prompt_token_ids, params, priority=0, *, keep_kv=False,
                                     decide=None, deadline=None):
        self.reserved.append(dict(request_id=request_id, prompt=list(prompt_token_ids), priority=priority,
                                  keep_kv=keep_kv))
        if decide is not None:
            self.decided.append(decide(self.num_cached))
            if not self.decided[-1]:
                return None
        if self.pool_full:
            return None
        n = -(-len(prompt_token_ids) // BLOCK)
        return RemotePrefillSlot([100 + 3 * i for i in range(n)], self.num_cached, BLOCK, len(prompt_token_ids))

    def finish_remote_prefill(self, request_id, kv_written):
        self.calls.append(("finish", request_id, kv_written))

    def abort(self, request_id):
        self.calls.append(("abort", request_id))

    def discard_stream(self, request_id):
        self.calls.append(("discard", request_id))

    def release_kv(self, request_id):
        self.calls.append(("release", request_id))

    async def stream(self, request_id):
        for out in self.outputs.get(request_id, ()):
            yield out


def make(*, engine=None, max_local=32, num_queued: int | None = 0, timeout_s=TIMEOUT_S,
         write_timeout_s=WRITE_TIMEOUT_S):
    engine = engine or FakeEngine()
    prefills = RemotePrefills(worker_id="decode-1", model=MODEL, engine=engine,
                              config=DisaggConfig(max_local_prefill_tokens=max_local, max_prefill_queue=4),
                              timeout_s=timeout_s, write_timeout_s=write_timeout_s)
    prefills.observe_queue(NOW, num_queued)
    return prefills, engine


def request(rid="r1", prompt=PROMPT, priority=0):
    return GenerateRequest(request_id=rid, model=MODEL, prompt_token_ids=prompt, priority=priority)


PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


async def reserve(prefills, rid="r1", *, now=NOW, has_prefill_workers=True, **kw):
    return await prefills.reserve(request(rid, **kw), PARAMS, now=now, has_prefill_workers=has_prefill_workers)


def note(transfer_id, rid="r1", status="ok", **kw) -> bytes:
    return PrefillNotification(transfer_id=transfer_id, request_id=rid, status=status, **kw).to_bytes()


# -- reserving: what goes on the prefill queue ----------------------------------------------------------

async def test_an_unreadable_queue_state_means_a_local_prefill():
    prefills, engine = make(num_queued=None)
    assert await reserve(prefills) is None
    assert engine.decided == [False] and not prefills.has_waiting  # the policy said local: nothing reserved


async def test_the_reservation_carries_its_write_window():
    prefills, engine = make(engine=FakeEngine(num_cached=32))
    prefill = await reserve(prefills, priority=3)
    assert prefill is not None
    assert engine.reserved == [dict(request_id="r1", prompt=PROMPT, priority=3, keep_kv=True)]
    assert engine.decided == [True]
    msg = RemotePrefillRequest.from_bytes(prefill.message.to_bytes())  # as a prefill worker reads it
    assert msg.transfer_id == prefill.transfer_id
    assert (msg.request_id, msg.model, msg.decode_worker_id, msg.priority) == ("r1", MODEL, "decode-1", 3)
    assert msg.prompt_token_ids == PROMPT
    assert msg.block_ids == [100 + 3 * i for i in range(7)] and msg.block_size == BLOCK
    assert msg.num_cached_tokens == 32 and msg.write_block_ids == msg.block_ids[2:6]
    # reserved at created_at; the window ends timeout_s later, and the last write must start early
    # enough to end (write_timeout_s) before it, with a margin for the clocks
    assert msg.created_at == NOW and prefill.window_end == NOW + TIMEOUT_S
    assert msg.write_deadline == NOW + TIMEOUT_S - WRITE_TIMEOUT_S - CLOCK_MARGIN_S
    assert msg.write_timeout_s == WRITE_TIMEOUT_S
    assert prefills.has_waiting and not prefill.future.done()


async def test_each_reservation_gets_its_own_transfer_id():
    prefills, _ = make()
    a = await reserve(prefills, "a")
    b = await reserve(prefills, "b")
    assert a.transfer_id != b.transfer_id
    assert a.message.transfer_id == a.transfer_id and b.message.transfer_id == b.transfer_id


@pytest.mark.parametrize("case", ["no prefill worker", "no queue", "queue full", "mostly cached", "pool full"])
async def test_reserve_prefills_locally(case):
    engine = FakeEngine(num_cached=80 if case == "mostly cached" else 0, pool_full=case == "pool full")
    prefills, engine = make(engine=engine, num_queued={"no queue": None, "queue full": 4}.get(case, 0))
    assert await reserve(prefills, has_prefill_workers=case != "no prefill worker") is None
    assert not prefills.has_waiting
    # the policy, asked once with the cached prefix and what was observed, says local; or the pool is full
    assert engine.decided == ([True] if case == "pool full" else [False])


def test_a_short_prompt_needs_no_queue_state_nor_engine():
    prefills, _ = make(max_local=32)
    assert not prefills.may_go_remote(32, NOW)  # at most max_local uncached tokens even with nothing cached
    assert not prefills.may_go_remote(15, NOW)
    assert prefills.may_go_remote(33, NOW)


def test_the_queue_state_is_read_again_once_it_is_old():
    prefills, _ = make()
    assert not prefills.needs_queue_state(NOW + QUEUE_STATE_MAX_AGE_S)
    assert prefills.needs_queue_state(NOW + QUEUE_STATE_MAX_AGE_S + 0.01)


async def test_the_latest_queue_state_steers_the_policy():
    prefills, engine = make(num_queued=4)  # full: local
    assert await reserve(prefills, "a") is None
    prefills.observe_queue(NOW + 1, 3)
    assert await reserve(prefills, "b", now=NOW + 1) is not None
    assert engine.decided == [False, True]


async def test_a_failed_publish_resolves_the_wait_at_once(caplog):
    prefills, engine = make()
    prefill = await reserve(prefills)
    with caplog.at_level(logging.WARNING, logger="shared.disagg.remote_prefill"):
        prefills.publish_failed(prefill, TimeoutError("nats away"))
    assert prefill.future.done() and prefill.future.result() is None
    assert "publish failed (nats away)" in caplog.text
    assert [out async for out in prefills.outputs(prefill)] == []
    assert engine.calls == [("finish", "r1", False)]
    assert prefills.num_fallbacks == 1 and not prefills.has_waiting


def test_the_timeout_must_cover_the_write_timeout_and_the_margin():
    with pytest.raises(ValueError, match="must exceed"):
        make(timeout_s=5.0, write_timeout_s=5.0 - CLOCK_MARGIN_S)
    make(timeout_s=5.0, write_timeout_s=4.0)


# -- notifications ------------------------------------------------------------------------------------

async def test_the_notification_for_the_transfer_resolves_its_wait():
    prefills, _ = make()
    a = await reserve(prefills, "a")
    b = await reserve(prefills, "b")
    prefills.deliver(note(b.transfer_id, "b", num_blocks=6, prefill_worker_id="prefill-1"), 1234)
    got = b.future.result()
    assert (got.transfer_id, got.request_id, got.status, got.num_blocks) == (b.transfer_id, "b", "ok", 6)
    assert not a.future.done()  # only the transfer it names


async def test_repeated_unknown_and_malformed_notifications_are_ignored(caplog):
    prefills, _ = make()
    prefill = await reserve(prefills)
    with caplog.at_level(logging.INFO, logger="shared.disagg.remote_prefill"):
        prefills.deliver(b"\x00not json", 0)
        prefills.deliver(b'{"request_id": "r1"}', 0)  # no transfer id
        prefills.deliver(note(prefill.transfer_id).replace(b'"ok"', b'"maybe"'), 0)
        assert not prefill.future.done()
        prefills.deliver(note("f" * 32), 0)  # a transfer this worker never started
        assert not prefill.future.done()
        prefills.deliver(note(prefill.transfer_id, num_blocks=6), 4096)
        first = prefill.future.result()
        prefills.deliver(note(prefill.transfer_id, status="failed", message="again"), 0)  # redelivered
    assert prefill.future.result() is first and first.status == "ok"
    assert caplog.text.count("malformed KV notification") == 3
    assert caplog.text.count("late or repeated") == 2


async def test_a_late_notification_after_the_request_moved_on_is_ignored():
    prefills, engine = make()
    prefill = await reserve(prefills)
    prefills.cancel("r1")
    assert [out async for out in prefills.outputs(prefill)] == []
    assert not prefills.has_waiting
    prefills.deliver(note(prefill.transfer_id), 4096)  # forgotten: nothing to resolve, no error
    assert engine.calls == [("finish", "r1", False)]


async def test_cancel_resolves_the_wait_with_none():
    prefills, _ = make()
    a = await reserve(prefills, "a")
    b = await reserve(prefills, "b")
    prefills.cancel("a")
    assert a.future.result() is None
    assert not b.future.done()
    prefills.cancel("a")  # again, or for an unknown request: nothing happens
    prefills.cancel("nobody")
    assert a.future.result() is None
    # a notification after the cancel does not override it
    prefills.deliver(note(a.transfer_id, "a"), 4096)
    assert a.future.result() is None


async def test_cancel_after_the_notification_keeps_the_notification():
    prefills, _ = make()
    prefill = await reserve(prefills)
    prefills.deliver(note(prefill.transfer_id), 4096)
    prefills.cancel("r1")
    assert prefill.future.result().status == "ok"


# -- the window: waiting for the KV, then holding the blocks ----------------------------------------------

async def test_no_kv_by_the_end_of_the_window_means_a_local_prefill(caplog):
    prefills, engine = make()
    prefill = await reserve(prefills)
    prefills.tick(prefill.window_end - 0.001)
    assert not prefill.future.done()
    with caplog.at_level(logging.WARNING, logger="shared.disagg.remote_prefill"):
        prefills.tick(prefill.window_end)
    assert prefill.future.result() is None and "no KV from a prefill worker within 30.0s" in caplog.text
    assert [out async for out in prefills.outputs(prefill)] == []
    assert prefills.num_fallbacks == 1
    # the window has closed: the next tick gives the blocks back
    prefills.tick(prefill.window_end)
    assert engine.calls == [("finish", "r1", False), ("release", "r1")]


def lease(prefills, prefill, now, worker="prefill-1"):
    """A prefill worker claims or renews its lease on ``prefill``'s blocks at ``now``."""
    return prefills.grant_lease(PrefillLeaseRequest(transfer_id=prefill.transfer_id, request_id=prefill.request_id,
                                                    prefill_worker_id=worker), now)


async def test_ok_notification_joins_the_decode_batch_and_holds_the_blocks_until_the_lease_expires():
    prefills, engine = make()
    prefill = await reserve(prefills)
    expires_at = lease(prefills, prefill, NOW + 1).expires_at
    assert expires_at == NOW + 1 + prefills.leases.lease_s
    engine.outputs["r1"] = [EngineOutput("r1", [5], None, None, len(PROMPT), 0, 1),
                            EngineOutput("r1", [6], None, "length", len(PROMPT), 0, 2)]
    prefills.deliver(note(prefill.transfer_id), 4096)
    got = [t for out in [o async for o in prefills.outputs(prefill)] for t in out.new_token_ids]
    assert got == [5, 6]
    assert prefill.kv_written and prefills.num_remote == 1 and prefills.num_fallbacks == 0
    assert not prefills.has_waiting
    # the request is done but its writer may still write until its lease expires: the blocks stay held
    prefills.tick(expires_at - 0.001)
    assert engine.calls == [("finish", "r1", True)]
    prefills.tick(expires_at)
    assert engine.calls == [("finish", "r1", True), ("release", "r1")]
    prefills.tick(expires_at + 60)  # released once
    assert engine.calls.count(("release", "r1")) == 1
    assert lease(prefills, prefill, NOW + 2).expires_at is None  # nothing more is granted on it


async def test_a_lapsed_lease_means_a_local_prefill_and_the_blocks_back_at_once(caplog):
    """The prefill worker that claimed the blocks stops renewing (it died): when its lease expires
    the request prefills locally, long before the window ends, and a late claim is refused."""
    prefills, engine = make()
    prefill = await reserve(prefills)
    lease(prefills, prefill, NOW + 1)
    expires_at = lease(prefills, prefill, NOW + 2).expires_at  # a renewal, then silence
    prefills.tick(expires_at - 0.001)
    assert not prefill.future.done()
    with caplog.at_level(logging.WARNING, "shared.disagg.remote_prefill"):
        prefills.tick(expires_at)
    assert prefill.future.done() and prefill.future.result() is None
    assert "lease lapsed" in caplog.text
    assert expires_at < prefill.window_end
    assert lease(prefills, prefill, expires_at + 0.1, worker="prefill-1").expires_at is None  # it woke up
    assert [out async for out in prefills.outputs(prefill)] == []
    assert engine.calls == [("finish", "r1", False)] and prefills.num_fallbacks == 1
    prefills.tick(expires_at + 0.1)  # no lease can be valid any more: released on the next tick
    assert engine.calls[-1] == ("release", "r1")


async def test_a_second_holder_keeps_the_reservation_alive():
    """A redelivery to another prefill worker while the first is slow: either may write."""
    prefills, engine = make()
    prefill = await reserve(prefills)
    first = lease(prefills, prefill, NOW + 1).expires_at
    second = lease(prefills, prefill, NOW + 3, worker="prefill-2").expires_at
    prefills.tick(first)
    assert not prefill.future.done()
    prefills.tick(second)
    assert prefill.future.done()


async def test_an_unclaimed_reservation_waits_for_its_window():
    prefills, engine = make()
    prefill = await reserve(prefills)
    prefills.tick(prefill.window_end - 0.001)
    assert not prefill.future.done()
    assert prefills.leases.lapsed(prefill.window_end - 0.001) == []


@pytest.mark.parametrize("how", ["failed", "cancel"])
async def test_no_kv_means_a_local_prefill(how):
    prefills, engine = make()
    prefill = await reserve(prefills)
    if how == "failed":
        prefills.deliver(note(prefill.transfer_id, status="failed", message="out of blocks"), 0)
    else:
        prefills.cancel("r1")
    assert [out async for out in prefills.outputs(prefill)] == []
    assert not prefill.kv_written and prefills.num_fallbacks == 1 and prefills.num_remote == 0
    assert engine.calls == [("finish", "r1", False)]


async def test_a_cancelled_wait_aborts_the_request_and_holds_its_blocks_for_the_lease():
    prefills, engine = make()
    prefill = await reserve(prefills)
    expires_at = lease(prefills, prefill, NOW + 1).expires_at
    task = asyncio.ensure_future(anext(prefills.outputs(prefill)))
    await asyncio.sleep(0)  # one loop turn: the task runs up to its wait for the notification
    assert not task.done() and engine.calls == []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.calls == [("abort", "r1"), ("finish", "r1", False), ("discard", "r1")]
    assert not prefills.has_waiting
    prefills.tick(expires_at - 0.001)
    assert engine.calls[-1] == ("discard", "r1")
    prefills.tick(expires_at)
    assert engine.calls[-1] == ("release", "r1")


# -- the service's poller ------------------------------------------------------------------------------------

class FakeTransfer:
    """KV notifications in batches, one batch a poll; then the poller is stopped."""

    def __init__(self, batches) -> None:
        self.batches = list(batches)

    def get_notifications(self):
        if not self.batches:
            raise asyncio.CancelledError
        batch = self.batches.pop(0)
        if isinstance(batch, Exception):
            raise batch
        return batch


async def test_the_poller_delivers_notifications_and_ticks():
    import time

    from services.decode.remote import RemotePrefiller

    prefills, _ = make()
    now = time.time()  # the poller ticks with the real clock
    prefills.observe_queue(now, 0)
    a = await reserve(prefills, "a", now=now)
    b = await reserve(prefills, "b", now=now)
    late = await reserve(prefills, "late", now=now - TIMEOUT_S)  # its window has closed already
    transfer = FakeTransfer([
        [SimpleNamespace(peer="p", message=note(a.transfer_id, "a"), num_bytes=10)],
        RuntimeError("backend hiccup"),  # logged; the ticks go on
        [SimpleNamespace(peer="p", message=b"garbage", num_bytes=0),
         SimpleNamespace(peer="p", message=note(b.transfer_id, "b", status="failed"), num_bytes=0)],
    ])
    poller = RemotePrefiller(prefills, bus=None, registry=None, transfer=transfer, subjects=None)
    with pytest.raises(asyncio.CancelledError):  # the fake runs dry after three polls
        await poller.poll_forever()
    assert a.future.result().status == "ok"
    assert b.future.result().status == "failed"
    assert late.future.result() is None


async def test_without_nixl_the_decode_worker_says_so_and_prefills_locally(monkeypatch, caplog):
    """No NIXL on the platform: no transfer, remote prefill off, and a log line saying why; a flip to
    prefill is refused (before anything drains) with the same reason."""
    import shared.transfer.nixl as nixl
    from services.decode.config import DecodeSettings
    from services.worker.process import WorkerRoles
    from shared.bus import ServiceError
    from shared.transfer import TransferUnavailable

    def unavailable(*args, **kw):
        raise TransferUnavailable("NIXL is not importable on this platform (test)")

    monkeypatch.setattr(nixl, "NixlTransfer", unavailable)
    roles = WorkerRoles(DecodeSettings(), engine=None, bus=None, registry=None)
    with caplog.at_level("WARNING"):
        assert roles.open_transfer() is None
    assert "remote prefill OFF: NIXL is not importable" in caplog.text
    with pytest.raises(ServiceError, match="NIXL is not importable"):
        roles.check("prefill")


async def test_a_written_remote_prefill_knows_its_timeline_for_the_ttft_phases():
    from shared.telemetry.phases import RemoteTimes

    prefills, engine = make()
    prefill, failed = await reserve(prefills), await reserve(prefills, "r2")
    prefill.published_at = failed.published_at = 100.0
    engine.outputs["r1"] = [EngineOutput("r1", [5], None, "length", len(PROMPT), 0, 1)]
    prefills.deliver(note(prefill.transfer_id, queue_wait_s=0.2, prefill_s=0.5), 4096, received_at=101.0)
    prefills.deliver(note(failed.transfer_id, "r2", status="failed"), 0, received_at=101.0)
    assert prefill.times() is None  # not before the request has taken its notification
    _ = [out async for out in prefills.outputs(prefill)]
    _ = [out async for out in prefills.outputs(failed)]
    assert prefill.times() == RemoteTimes(100.0, 101.0, 0.2, 0.5)
    assert failed.times() is None  # no KV written: it prefilled locally, the engine dates that
