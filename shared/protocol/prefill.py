"""Remote prefill: a decode worker's request on the JetStream prefill queue, and what the prefill
worker tells the decode worker through the NIXL notification that follows its write. Also the
peer fetch of a cached prefix from one decode worker into another (``KvFetchRequest``), which
reuses that notification."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shared.protocol.base import BlockHash, RequestId, WireModel, WorkerId

NotificationStatus = Literal["ok", "failed"]


class RemotePrefillRequest(WireModel):
    """Compute ``prompt_token_ids``' KV and write it into the decode worker's ``block_ids``.

    ``block_ids`` is the decode worker's block table for the whole prompt (``block_size`` tokens
    per block). Its first ``num_cached_tokens // block_size`` blocks already hold the decode
    worker's cached prefix and are not written. Only *full* prompt blocks are written: the partial
    tail block, where the decode worker will also put generated tokens, is recomputed there, so a
    repeated (redelivered) write can never overwrite anything but identical prompt KV.

    No write may *start* after ``write_deadline`` (epoch seconds) and none may take longer than
    ``write_timeout_s``: after ``write_deadline + write_timeout_s`` the decode worker knows no
    transfer into the blocks is in flight and may reuse them.
    """

    request_id: RequestId
    transfer_id: str = Field(min_length=1, max_length=64)  # one reservation: the notification names it
    model: str
    prompt_token_ids: list[int] = Field(min_length=1)
    decode_worker_id: WorkerId  # its NIXL metadata is under this key in the ``<ns>-nixl`` bucket
    block_ids: list[int]
    block_size: int = Field(ge=1)
    num_cached_tokens: int = Field(0, ge=0)
    write_deadline: float
    write_timeout_s: float = Field(gt=0)
    priority: int = 0
    created_at: float = 0.0

    @model_validator(mode="after")
    def _blocks_cover_the_prompt(self) -> "RemotePrefillRequest":
        need = -(-len(self.prompt_token_ids) // self.block_size)
        if len(self.block_ids) != need:
            raise ValueError(f"{len(self.block_ids)} block ids for a {len(self.prompt_token_ids)}-token prompt "
                             f"in {self.block_size}-token blocks (need {need})")
        if self.num_cached_tokens % self.block_size or self.num_cached_tokens >= len(self.prompt_token_ids):
            raise ValueError(f"num_cached_tokens {self.num_cached_tokens} must be a multiple of block_size "
                             f"below the prompt length")
        return self

    @property
    def num_full_blocks(self) -> int:
        return len(self.prompt_token_ids) // self.block_size

    @property
    def first_block(self) -> int:
        """Index (into ``block_ids``) of the first block to write."""
        return self.num_cached_tokens // self.block_size

    @property
    def write_block_ids(self) -> list[int]:
        """The decode worker's blocks this request writes: full, uncached prompt blocks."""
        return self.block_ids[self.first_block:self.num_full_blocks]


class PrefillNotification(WireModel):
    """The message of the NIXL notification a prefill worker sends after its write (``ok``), or
    instead of one when it gives up on the request (``failed``: the decode worker prefills locally
    at once instead of waiting for its timeout)."""

    transfer_id: str
    request_id: RequestId
    status: NotificationStatus = "ok"
    num_blocks: int = Field(0, ge=0)
    prefill_worker_id: WorkerId | None = None
    message: str = ""
    # ``ok`` only: how long the request waited on the prefill queue and how long its prefill took
    # (seconds, measured at the prefill worker), for the decode worker's TTFT phases
    queue_wait_s: float | None = Field(None, ge=0)
    prefill_s: float | None = Field(None, ge=0)


class PrefillLeaseRequest(WireModel):
    """A prefill worker claims (or renews) its lease on a reservation before it may write into it
    (``shared.disagg.lease``)."""

    transfer_id: str
    request_id: RequestId
    prefill_worker_id: WorkerId


class PrefillLeaseResult(WireModel):
    """``expires_at`` (epoch seconds): the lease holds until then; None: refused, drop the request
    (the decode worker no longer waits for its KV). Renew before ``lease_s`` has run out."""

    transfer_id: str
    expires_at: float | None = None
    lease_s: float = Field(0.0, ge=0)


class PrefillQueueStatus(WireModel):
    """The prefill queue as ``/status`` shows it (its durable consumers' counters, summed over the
    priority levels)."""

    num_pending: int = Field(0, ge=0)  # queued, not yet taken by a prefill worker
    num_ack_pending: int = Field(0, ge=0)  # taken, not yet acknowledged (being prefilled)
    num_redelivered: int = Field(0, ge=0)
    num_waiting_pulls: int = Field(0, ge=0)
    num_pending_by_level: list[int] = Field(default_factory=list)  # queued per priority level, highest first


class KvSource(WireModel):
    """Another worker holds more of the prompt's leading blocks than the chosen one: admission names
    it, and the chosen worker may fetch them from it (``KvFetchRequest``) instead of recomputing."""

    worker_id: WorkerId
    num_blocks: int = Field(ge=1)  # leading prompt blocks it holds, in any tier


class KvFetchRequest(WireModel):
    """Write the cached blocks ``block_hashes[first_block:]`` of the asking worker's prompt into its
    ``block_ids`` (paired by position), then send a ``PrefillNotification`` whose ``transfer_id``
    is ``fetch_id`` and answer with a ``KvFetchResult``. ``block_hashes`` is the prompt's chain from
    its first block, so the holder finds the run as a prefix match; it writes the longest run it
    holds, possibly shorter than asked. Same write rules as remote prefill: no write starts after
    ``write_deadline`` (epoch seconds), none lasts longer than ``write_timeout_s``."""

    fetch_id: str = Field(min_length=1, max_length=64)
    request_id: RequestId
    model: str
    decode_worker_id: WorkerId  # the asking worker: its NIXL metadata is under this key
    block_hashes: list[BlockHash] = Field(min_length=1)
    first_block: int = Field(0, ge=0)
    block_ids: list[int] = Field(min_length=1)
    write_deadline: float
    write_timeout_s: float = Field(gt=0)

    @model_validator(mode="after")
    def _ids_fit_the_run(self) -> "KvFetchRequest":
        if self.first_block + len(self.block_ids) != len(self.block_hashes):
            raise ValueError(f"{len(self.block_ids)} block ids from block {self.first_block} do not end the "
                             f"{len(self.block_hashes)}-block chain")
        return self


class KvFetchResult(WireModel):
    """``num_blocks``: how many of the asked blocks were written (the first ones, in order); 0 with
    ``message`` when the holder had none, refused or failed. Sent after the write completed."""

    fetch_id: str
    num_blocks: int = Field(0, ge=0)
    message: str = ""
    # 0 blocks after a write that was started and failed: it may still land until the ask's
    # ``write_deadline + write_timeout_s``, so the asking worker must not reuse the blocks before
    write_failed: bool = False
