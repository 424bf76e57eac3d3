"""The decode worker's remote-prefill bookkeeping (services.decode.remote) with fakes: no sockets,
no model. What is published on the prefill queue, and how NIXL notifications (right, repeated,
unknown, malformed) and cancellations resolve a waiting request."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

from services.decode.remote import _CLOCK_MARGIN_S, RemotePrefiller
from shared.engine import EngineOutput, SamplingParams
from shared.engine.engine import RemotePrefillSlot
from shared.policy.disagg import DisaggConfig
from shared.protocol import GenerateRequest, PrefillNotification, RemotePrefillRequest, Subjects

MODEL = "smollm2-135m"
BLOCK = 16
PROMPT = list(range(1, 101))  # 100 tokens: 6 full blocks and a partial one
TIMEOUT_S, WRITE_TIMEOUT_S = 30.0, 5.0  # the window never closes during a test


class FakeBus:
    def __init__(self, *, num_pending: int | None = 0, publish_error: Exception | None = None,
                 info_error: Exception | None = None) -> None:
        self.num_pending = num_pending
        self.publish_error = publish_error
        self.info_error = info_error
        self.published: list[tuple[str, RemotePrefillRequest]] = []
        self.consumer_info_calls: list[tuple[str, str]] = []

    async def js_publish(self, endpoint, payload, **kw):
        if self.publish_error is not None:
            raise self.publish_error
        # what crosses the wire, parsed back as a prefill worker would
        self.published.append((endpoint.subject, endpoint.request_type.from_bytes(payload.to_bytes())))
        return len(self.published)

    async def consumer_info(self, stream, durable):
        self.consumer_info_calls.append((stream, durable))
        if self.info_error is not None:
            raise self.info_error
        return None if self.num_pending is None else SimpleNamespace(num_pending=self.num_pending)


class FakeRegistry:
    def __init__(self, workers=None) -> None:
        self.workers = [SimpleNamespace(role="prefill", state="ready", model=MODEL)] if workers is None else workers

    async def list(self):
        return list(self.workers)


class FakeEngine:
    """An AsyncEngine's remote-prefill surface: records what the prefiller asks of it."""

    block_size = BLOCK

    def __init__(self, *, num_cached: int = 0, pool_full: bool = False) -> None:
        self.num_cached = num_cached
        self.pool_full = pool_full
        self.reserved: list[dict] = []
        self.decided: list[bool] = []
        self.calls: list[tuple] = []
        self.outputs: dict[str, list[EngineOutput]] = {}

    async def reserve_remote_prefill(self, request_id, prompt_token_ids, params, priority=0, *, keep_kv=False,
                                     decide=None):
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


class FakeTransfer:
    def __init__(self, batches) -> None:
        self.batches = list(batches)

    def get_notifications(self):
        if not self.batches:
            raise _Stop
        return self.batches.pop(0)


class _Stop(Exception):
    pass


def make(*, bus=None, registry=None, engine=None, transfer=None, max_local=32, timeout_s=TIMEOUT_S,
         write_timeout_s=WRITE_TIMEOUT_S):
    bus, registry, engine = bus or FakeBus(), registry or FakeRegistry(), engine or FakeEngine()
    prefiller = RemotePrefiller(
        worker_id="decode-1", model=MODEL, bus=bus, registry=registry, engine=engine,
        transfer=transfer or FakeTransfer([]), subjects=Subjects(),
        config=DisaggConfig(max_local_prefill_tokens=max_local, max_prefill_queue=4),
        timeout_s=timeout_s, write_timeout_s=write_timeout_s)
    return prefiller, bus, engine


def request(rid="r1", prompt=PROMPT, priority=0):
    return GenerateRequest(request_id=rid, model=MODEL, prompt_token_ids=prompt, priority=priority)


PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def note(transfer_id, rid="r1", status="ok", **kw) -> bytes:
    return PrefillNotification(transfer_id=transfer_id, request_id=rid, status=status, **kw).to_bytes()


# -- start: what goes on the prefill queue ------------------------------------------------------------

async def test_an_unreadable_queue_state_means_a_local_prefill():
    prefiller, bus, engine = make(bus=FakeBus(info_error=ConnectionError("reconnecting")))
    assert await prefiller.start(request(), PARAMS) is None
    assert engine.reserved == [] and bus.published == []


async def test_start_publishes_the_reservation_with_its_write_window():
    prefiller, bus, engine = make(engine=FakeEngine(num_cached=32))
    before = time.time()
    handle = await prefiller.start(request(priority=3), PARAMS)
    after = time.time()
    assert handle is not None
    assert engine.reserved == [dict(request_id="r1", prompt=PROMPT, priority=3, keep_kv=True)]
    assert engine.decided == [True]
    [(subject, msg)] = bus.published
    assert subject == Subjects().prefill_queue().subject
    assert msg.transfer_id == handle.transfer_id
    assert (msg.request_id, msg.model, msg.decode_worker_id, msg.priority) == ("r1", MODEL, "decode-1", 3)
    assert msg.prompt_token_ids == PROMPT
    assert msg.block_ids == [100 + 3 * i for i in range(7)] and msg.block_size == BLOCK
    assert msg.num_cached_tokens == 32 and msg.write_block_ids == msg.block_ids[2:6]
    # reserved at created_at; the window ends timeout_s later, and the last write must start early
    # enough to end (write_timeout_s) before it, with a margin for the clocks
    assert before <= msg.created_at <= after
    assert handle.window_end == pytest.approx(msg.created_at + TIMEOUT_S)
    assert msg.write_deadline == pytest.approx(msg.created_at + TIMEOUT_S - WRITE_TIMEOUT_S - _CLOCK_MARGIN_S)
    assert msg.write_timeout_s == WRITE_TIMEOUT_S
    assert prefiller._pending[handle.transfer_id].request_id == "r1"
    assert prefiller._by_request == {"r1": handle.transfer_id}
    assert not prefiller._pending[handle.transfer_id].future.done()


async def test_each_reservation_gets_its_own_transfer_id():
    prefiller, bus, _ = make()
    a = await prefiller.start(request("a"), PARAMS)
    b = await prefiller.start(request("b"), PARAMS)
    assert a.transfer_id != b.transfer_id
    assert [m.transfer_id for _, m in bus.published] == [a.transfer_id, b.transfer_id]
    assert set(prefiller._pending) == {a.transfer_id, b.transfer_id}


@pytest.mark.parametrize("case", ["short prompt", "no prefill worker", "other model", "prefill worker not ready",
                                  "no queue", "queue full", "mostly cached", "pool full"])
async def test_start_prefills_locally_without_publishing(case):
    bus = FakeBus(num_pending={"no queue": None, "queue full": 4}.get(case, 0))
    workers = {"no prefill worker": [SimpleNamespace(role="decode", state="ready", model=MODEL)],
               "other model": [SimpleNamespace(role="prefill", state="ready", model="other")],
               "prefill worker not ready": [SimpleNamespace(role="prefill", state="draining", model=MODEL)]}
    engine = FakeEngine(num_cached=80 if case == "mostly cached" else 0, pool_full=case == "pool full")
    prefiller, bus, engine = make(bus=bus, registry=FakeRegistry(workers.get(case)), engine=engine)
    prompt = PROMPT[:20] if case == "short prompt" else PROMPT
    assert await prefiller.start(request(prompt=prompt), PARAMS) is None
    assert bus.published == [] and prefiller._pending == {} and prefiller._by_request == {}
    if case in ("mostly cached", "queue full"):  # the policy, asked with the cached prefix, says local
        assert engine.decided == [False]
    if case in ("short prompt", "no prefill worker", "other model", "prefill worker not ready", "no queue"):
        assert engine.reserved == []  # no reservation asked for at all


async def test_a_failed_publish_resolves_the_wait_at_once(caplog):
    prefiller, _, engine = make(bus=FakeBus(publish_error=TimeoutError("nats away")))
    with caplog.at_level(logging.WARNING, logger="services.decode.remote"):
        handle = await prefiller.start(request(), PARAMS)
    assert handle is not None  # the blocks are reserved: the request goes on, prefilling locally
    pending = prefiller._pending[handle.transfer_id]
    assert pending.future.done() and pending.future.result() is None
    assert "publish failed" in caplog.text
    assert [out async for out in handle.outputs()] == []
    assert engine.calls == [("finish", "r1", False)]
    assert prefiller.num_fallbacks == 1 and prefiller._pending == {}


def test_the_timeout_must_cover_the_write_timeout_and_the_margin():
    with pytest.raises(ValueError, match="must exceed"):
        make(timeout_s=5.0, write_timeout_s=5.0 - _CLOCK_MARGIN_S)
    make(timeout_s=5.0, write_timeout_s=4.0)


# -- notifications ------------------------------------------------------------------------------------

async def test_the_notification_for_the_transfer_resolves_its_wait():
    prefiller, _, _ = make()
    a = await prefiller.start(request("a"), PARAMS)
    b = await prefiller.start(request("b"), PARAMS)
    prefiller.deliver(note(b.transfer_id, "b", num_blocks=6, prefill_worker_id="prefill-1"), 1234)
    got = prefiller._pending[b.transfer_id].future.result()
    assert (got.transfer_id, got.request_id, got.status, got.num_blocks) == (b.transfer_id, "b", "ok", 6)
    assert not prefiller._pending[a.transfer_id].future.done()  # only the transfer it names


async def test_repeated_unknown_and_malformed_notifications_are_ignored(caplog):
    prefiller, _, _ = make()
    handle = await prefiller.start(request(), PARAMS)
    future = prefiller._pending[handle.transfer_id].future
    with caplog.at_level(logging.INFO, logger="services.decode.remote"):
        prefiller.deliver(b"\x00not json", 0)
        prefiller.deliver(b'{"request_id": "r1"}', 0)  # no transfer id
        prefiller.deliver(note(handle.transfer_id).replace(b'"ok"', b'"maybe"'), 0)
        assert not future.done()
        prefiller.deliver(note("f" * 32), 0)  # a transfer this worker never started
        assert not future.done()
        prefiller.deliver(note(handle.transfer_id, num_blocks=6), 4096)
        first = future.result()
        prefiller.deliver(note(handle.transfer_id, status="failed", message="again"), 0)  # redelivered
    assert future.result() is first and first.status == "ok"
    assert caplog.text.count("malformed KV notification") == 3
    assert caplog.text.count("late or repeated") == 2


async def test_a_late_notification_after_the_request_moved_on_is_ignored():
    prefiller, _, engine = make()
    handle = await prefiller.start(request(), PARAMS)
    prefiller.cancel("r1")
    assert [out async for out in handle.outputs()] == []
    assert prefiller._pending == {} and prefiller._by_request == {}
    prefiller.deliver(note(handle.transfer_id), 4096)  # forgotten: nothing to resolve, no error
    assert engine.calls == [("finish", "r1", False)]


async def test_cancel_resolves_the_wait_with_none():
    prefiller, _, _ = make()
    a = await prefiller.start(request("a"), PARAMS)
    b = await prefiller.start(request("b"), PARAMS)
    prefiller.cancel("a")
    assert prefiller._pending[a.transfer_id].future.result() is None
    assert not prefiller._pending[b.transfer_id].future.done()
    prefiller.cancel("a")  # again, or for an unknown request: nothing happens
    prefiller.cancel("nobody")
    assert prefiller._pending[a.transfer_id].future.result() is None
    # a notification after the cancel does not override it
    prefiller.deliver(note(a.transfer_id, "a"), 4096)
    assert prefiller._pending[a.transfer_id].future.result() is None


async def test_cancel_after_the_notification_keeps_the_notification():
    prefiller, _, _ = make()
    handle = await prefiller.start(request(), PARAMS)
    prefiller.deliver(note(handle.transfer_id), 4096)
    prefiller.cancel("r1")
    assert prefiller._pending[handle.transfer_id].future.result().status == "ok"


async def test_receive_forever_delivers_the_transfers_notifications():
    prefiller, _, _ = make()
    a = await prefiller.start(request("a"), PARAMS)
    b = await prefiller.start(request("b"), PARAMS)
    prefiller.transfer = FakeTransfer([
        [SimpleNamespace(peer="p", message=note(a.transfer_id, "a"), num_bytes=10)],
        [SimpleNamespace(peer="p", message=b"garbage", num_bytes=0),
         SimpleNamespace(peer="p", message=note(b.transfer_id, "b", status="failed"), num_bytes=0)],
    ])
    with pytest.raises(_Stop):  # the fake runs dry after two polls
        await prefiller.receive_forever()
    assert prefiller._pending[a.transfer_id].future.result().status == "ok"
    assert prefiller._pending[b.transfer_id].future.result().status == "failed"


# -- the handle: what the engine is told once the wait is over -------------------------------------------

async def test_ok_notification_joins_the_decode_batch_and_holds_the_blocks():
    prefiller, _, engine = make()
    handle = await prefiller.start(request(), PARAMS)
    engine.outputs["r1"] = [EngineOutput("r1", [5], None, None, len(PROMPT), 0, 1),
                            EngineOutput("r1", [6], None, "length", len(PROMPT), 0, 2)]
    prefiller.deliver(note(handle.transfer_id), 4096)
    got = [t for out in [o async for o in handle.outputs()] for t in out.new_token_ids]
    assert got == [5, 6]
    assert handle.kv_written and prefiller.num_remote == 1 and prefiller.num_fallbacks == 0
    # the window is still open: the blocks are released later, not now
    assert engine.calls == [("finish", "r1", True)]
    assert prefiller._pending == {} and prefiller._by_request == {}


@pytest.mark.parametrize("how", ["failed", "cancel"])
async def test_no_kv_means_a_local_prefill(how):
    prefiller, _, engine = make()
    handle = await prefiller.start(request(), PARAMS)
    if how == "failed":
        prefiller.deliver(note(handle.transfer_id, status="failed", message="out of blocks"), 0)
    else:
        prefiller.cancel("r1")
    assert [out async for out in handle.outputs()] == []
    assert not handle.kv_written and prefiller.num_fallbacks == 1 and prefiller.num_remote == 0
    assert engine.calls == [("finish", "r1", False)]


async def test_a_cancelled_wait_aborts_the_request():
    prefiller, _, engine = make()
    handle = await prefiller.start(request(), PARAMS)
    task = asyncio.ensure_future(anext(handle.outputs()))
    await asyncio.sleep(0)  # one loop turn: the task runs up to its wait for the notification
    assert not task.done() and engine.calls == []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.calls == [("abort", "r1"), ("finish", "r1", False), ("discard", "r1")]
    assert prefiller._pending == {} and prefiller._by_request == {}


async def test_without_nixl_the_decode_worker_says_so_and_prefills_locally(monkeypatch, caplog):
    """No NIXL on the platform: no transfer, remote prefill off, and a log line saying why."""
    import shared.transfer.nixl as nixl
    from services.decode.config import DecodeSettings
    from services.decode.service import _open_transfer
    from shared.transfer import TransferUnavailable

    def unavailable(*args, **kw):
        raise TransferUnavailable("NIXL is not importable on this platform (test)")

    monkeypatch.setattr(nixl, "NixlTransfer", unavailable)
    with caplog.at_level("WARNING"):
        assert await _open_transfer(DecodeSettings(), bus=None, engine=None) == (None, None)
    assert "remote prefill OFF: NIXL is not importable" in caplog.text
