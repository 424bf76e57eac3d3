"""The prefill queue's priority levels on a real JetStream server: higher tiers are handed out
first, a waiting lower tier still progresses (LevelPicker's bound), and the queue's length as the
decode worker and /status read it covers every level."""

from __future__ import annotations

from shared.disagg.prefill_queue import PrefillQueues
from shared.protocol import RemotePrefillRequest, Subjects


def message(rid: str, priority: int) -> RemotePrefillRequest:
    return RemotePrefillRequest(request_id=rid, transfer_id=rid * 4, model="m", prompt_token_ids=[1] * 40,
                                decode_worker_id="d", block_ids=[1, 2, 3], block_size=16, num_cached_tokens=0,
                                write_deadline=0.0, write_timeout_s=1.0, priority=priority, created_at=0.0)


async def test_premium_first_and_batch_still_progresses(bus, namespace):
    s = Subjects(namespace)
    await bus.ensure_stream(s.prefill_stream, [s.prefill_queue_all().subject], max_age_s=60, max_msgs=100,
                            work_queue=True)
    queues = await PrefillQueues.open(bus, s, ack_wait_s=30, max_deliver=1, max_skips=3)
    # batch (priority 2) queued first, then premium (priority 0); priority 7 shares the last level
    for i in range(3):
        await bus.js_publish(s.prefill_queue(2), message(f"batch{i}", 2))
    await bus.js_publish(s.prefill_queue(7), message("bulk", 7))
    for i in range(5):
        await bus.js_publish(s.prefill_queue(0), message(f"premium{i}", 0))
    assert await queues.pending() == [5, 0, 4]
    order = []
    for _ in range(9):
        [msg] = await queues.fetch(1)
        order.append(msg.payload.request_id)
        await msg.ack()
    assert order == ["premium0", "premium1", "premium2", "batch0", "premium3", "premium4", "batch1",
                     "batch2", "bulk"]
    assert await queues.pending() == [0, 0, 0] and await queues.fetch(2) == []
    await queues.close()
