"""Writing KV blocks into a peer from an event loop: the one way both writers here (the prefill
worker into a decode worker's reservation, a decode worker lending its cached prefix) write."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence

from shared.transfer.base import KvTransfer, KVTransferFailed, TransferHandle


def pauses_until_written(transfer: KvTransfer, handle: TransferHandle, timeout_s: float, *,
                         first_pause_s: float) -> Iterator[float]:
    """Poll the write until it is done, yielding how long to pause before the next poll: none at
    first (small writes finish in microseconds), then from ``first_pause_s`` doubling up to a
    millisecond. After ``timeout_s``, cancel it and raise ``KVTransferFailed``. The caller sleeps
    each pause its own way (``wait_written`` on an event loop, a backend's blocking ``wait``)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0
    while not transfer.poll(handle):
        if time.monotonic() > deadline:
            transfer.cancel(handle)
            raise KVTransferFailed(f"write of {handle.num_bytes} B to {handle.peer!r} not done after {timeout_s:.3g}s")
        yield pause
        pause = min(max(pause * 2, first_pause_s), 1e-3)


def sleep_until_written(transfer: KvTransfer, handle: TransferHandle, timeout_s: float, *,
                        first_pause_s: float) -> None:
    """``transfer.wait`` for a thread that may block: sleep each pause of ``pauses_until_written``."""
    for pause in pauses_until_written(transfer, handle, timeout_s, first_pause_s=first_pause_s):
        if pause:
            time.sleep(pause)


async def wait_written(transfer: KvTransfer, handle: TransferHandle, timeout_s: float) -> None:
    """``transfer.wait`` for an event loop: poll without blocking it (other requests keep going)."""
    for pause in pauses_until_written(transfer, handle, timeout_s, first_pause_s=1e-4):
        await asyncio.sleep(pause)


async def write_and_wait(transfer: KvTransfer, peer: str, local_block_ids: Sequence[int],
                         remote_block_ids: Sequence[int], notify: bytes, timeout_s: float) -> None:
    """Write the blocks into ``peer`` (``notify`` follows them) and wait until done. On failure the
    peer is dropped, so that the next write reconnects from fresh metadata (a restarted worker
    publishes new metadata under the same id), and ``KVTransferFailed`` raised."""
    try:
        handle = transfer.write_blocks(peer, local_block_ids, remote_block_ids, notify)
        await wait_written(transfer, handle, timeout_s)
    except KVTransferFailed:
        transfer.remove_peer(peer)
        raise
