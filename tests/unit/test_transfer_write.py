"""shared.transfer.write_and_wait over a fake transfer: a write that completes keeps the peer; one
that fails to start, fails in flight or runs past its timeout drops the peer and raises."""

from __future__ import annotations

import pytest

from shared.transfer import KVTransferFailed, TransferHandle, write_and_wait


class FakeTransfer:
    def __init__(self, *, start_fails: bool = False, polls_until_done: int = 0, poll_fails: bool = False) -> None:
        self.start_fails = start_fails
        self.polls_left = polls_until_done
        self.poll_fails = poll_fails
        self.calls: list[tuple] = []

    def write_blocks(self, peer, local_block_ids, remote_block_ids, notify):
        self.calls.append(("write", peer, list(local_block_ids), list(remote_block_ids), notify))
        if self.start_fails:
            raise KVTransferFailed("unknown peer")
        return TransferHandle(peer, num_bytes=64, num_descriptors=1, notify=notify)

    def poll(self, handle):
        if self.poll_fails:
            raise KVTransferFailed("peer gone mid-transfer")
        self.polls_left -= 1
        return self.polls_left < 0

    def cancel(self, handle):
        self.calls.append(("cancel", handle.peer))

    def remove_peer(self, peer):
        self.calls.append(("remove", peer))


async def test_a_completed_write_keeps_the_peer():
    transfer = FakeTransfer(polls_until_done=3)
    await write_and_wait(transfer, "p", [1, 2], [7, 8], b"note", timeout_s=5.0)
    assert transfer.calls == [("write", "p", [1, 2], [7, 8], b"note")]


@pytest.mark.parametrize("how", ["start", "poll"])
async def test_a_failed_write_drops_the_peer(how):
    transfer = FakeTransfer(start_fails=how == "start", poll_fails=how == "poll")
    with pytest.raises(KVTransferFailed):
        await write_and_wait(transfer, "p", [1], [7], b"note", timeout_s=5.0)
    assert transfer.calls[-1] == ("remove", "p")


async def test_a_write_past_its_timeout_is_cancelled_and_drops_the_peer():
    transfer = FakeTransfer(polls_until_done=10**9)
    with pytest.raises(KVTransferFailed, match="not done after 0s"):
        await write_and_wait(transfer, "p", [1], [7], b"note", timeout_s=0.0)
    assert transfer.calls[1:] == [("cancel", "p"), ("remove", "p")]
