"""KvReservations: the engine's KV blocks that another worker writes or reads — remote prefill
slots, peer prefix fetches and lends, and the block tables a transfer moves. The one owner of the
disaggregation hooks; it runs in the engine thread (``AsyncEngine`` posts to it between steps)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.engine.outputs import EngineOutput, make_output
from shared.engine.request import Request, SamplingParams
from shared.engine.scheduler import Scheduler
from shared.kvcache.hashing import hash_blocks

# validates and builds a request: (request_id, prompt_token_ids, params, priority, keep_kv, deadline)
NewRequest = Callable[[str, list[int], SamplingParams, int, bool, "float | None"], Request]


@dataclass(frozen=True)
class RemotePrefillSlot:
    """Where a prefill worker writes a prompt's KV: the request's blocks, of which the first
    ``num_cached_tokens // block_size`` already hold the locally cached prefix. Only full prompt
    blocks are written (``transfer_block_ids``); the partial tail, which generated tokens will
    share, is recomputed locally, so a repeated write can only rewrite identical prompt KV."""

    block_ids: list[int]
    num_cached_tokens: int
    block_size: int
    num_prompt_tokens: int = 0

    @property
    def uncached_block_ids(self) -> list[int]:
        return self.block_ids[self.num_cached_tokens // self.block_size:]

    @property
    def transfer_block_ids(self) -> list[int]:
        """Full prompt blocks past the cached prefix: what a prefill worker writes."""
        return self.block_ids[self.num_cached_tokens // self.block_size:self.num_prompt_tokens // self.block_size]


@dataclass(frozen=True)
class PrefixFetchSlot:
    """Blocks held for a peer to write a prompt's cached prefix into (``reserve_prefix_fetch``):
    the prompt's first ``len(block_hashes)`` blocks, of which the first ``num_local`` are cached
    here already and ``block_ids`` are fresh, for the rest."""

    block_hashes: list[int]
    num_local: int
    block_ids: list[int]


class KvReservations:
    def __init__(self, scheduler: Scheduler, new_request: NewRequest) -> None:
        self._scheduler = scheduler
        self._kv = scheduler.kv
        self._block_size = scheduler.kv.block_size
        self._new_request = new_request
        self._fetches: dict[str, tuple[list[int], list[int], int]] = {}  # fetch id → hashes, tokens, cached here

    # -- remote prefill (decode side) and the prefill side's held blocks ----------------------------
    def reserve_remote_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                               priority: int = 0, *, keep_kv: bool = False,
                               decide: Callable[[int], bool] | None = None,
                               deadline: float | None = None) -> RemotePrefillSlot | None:
        """Decode side of remote prefill: reserve blocks for the prompt (reusing the local prefix
        cache) that a prefill worker will write. None when the pool cannot hold it now, or when
        ``decide(num_cached_tokens)`` — asked first, with the locally cached prefix — says no; in
        both cases nothing changed. ``keep_kv``: hold the blocks after the request ends (for any
        reason) until ``release_kv``, so a late write can never land in reused blocks."""
        request = self._new_request(request_id, prompt_token_ids, params, priority, keep_kv, deadline)
        reserved = self._scheduler.reserve_remote(request, decide)
        if reserved is None:
            return None
        block_ids, num_cached = reserved
        return RemotePrefillSlot(block_ids, num_cached, self._block_size, len(prompt_token_ids))

    def finish_remote_prefill(self, request_id: str, kv_written: bool) -> EngineOutput | None:
        """The transfer for a reserved request is over: with ``kv_written`` it joins the decode
        batch, otherwise it prefills locally. An aborted request's blocks are freed (and its abort
        output returned)."""
        request = self._scheduler.finish_remote(request_id, kv_written)
        if request is not None and request.status.is_finished:
            return make_output(request, [])
        return None

    def request_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: ids into the engine's ``kv_cache`` first dimension (see
        kvcache.layout). A KV transfer registers ``kv_cache`` once and moves blocks by these ids
        (shared/transfer)."""
        return self._kv.block_ids(request_id)

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks a finished ``keep_kv`` request holds; False if it holds none."""
        return self._scheduler.release(request_id)

    # -- peer fetch of a cached prefix (services/decode/fetch.py) -----------------------------------
    def reserve_prefix_fetch(self, fetch_id: str, prompt_token_ids: list[int],
                             num_blocks: int) -> PrefixFetchSlot | None:
        """Hold blocks for the prompt's first ``num_blocks`` full blocks (at most all but the one
        holding its last token, which is always computed here) so a peer can write those not
        cached here. None when the pool cannot hold them now or prefix caching is off. End it with
        ``finish_prefix_fetch``."""
        num_blocks = min(num_blocks, (len(prompt_token_ids) - 1) // self._block_size)
        if num_blocks <= 0:
            return None
        tokens = list(prompt_token_ids[:num_blocks * self._block_size])
        hashes = hash_blocks(tokens, self._block_size, self._scheduler.namespace)
        reserved = self._kv.reserve_fetch(_fetch_owner(fetch_id), hashes)
        if reserved is None:
            return None
        num_local, block_ids = reserved
        if block_ids:
            self._fetches[fetch_id] = (hashes, tokens, num_local)
        return PrefixFetchSlot(hashes, num_local, block_ids)

    def finish_prefix_fetch(self, fetch_id: str, num_written: int) -> None:
        """A peer wrote the first ``num_written`` fresh blocks of the fetch (0: none, or given up
        on once no write can still land): they join the prefix cache, and the blocks go back."""
        hashes, tokens, num_local = self._fetches.pop(fetch_id, ([], [], 0))
        self._kv.finish_fetch(_fetch_owner(fetch_id), tokens, hashes, num_local + num_written if num_written else 0)

    def read_prefix_from_disk(self, block_hashes: list[int]) -> bool:
        """Start reading the run of ``block_hashes`` this worker keeps on disk (after those in the
        pool or host memory) so that ``lend_prefix`` finds them; True while reads are under way."""
        self._kv.prefetch(block_hashes)
        return self._kv.is_loading(block_hashes)

    def lend_prefix(self, lend_id: str, block_hashes: list[int]) -> list[int]:
        """Pin the leading run of ``block_hashes`` cached here (pool, or host memory; disk blocks
        once ``read_prefix_from_disk`` brought them in) for a peer to read; their block ids.
        ``return_prefix`` unpins them."""
        return self._kv.lend(_lend_owner(lend_id), block_hashes)

    def return_prefix(self, lend_id: str) -> None:
        self._kv.free(_lend_owner(lend_id))


def _fetch_owner(fetch_id: str) -> str:
    return f"fetch:{fetch_id}"  # fetch and lend ids are ours (uuids): no request has such an id


def _lend_owner(lend_id: str) -> str:
    return f"lend:{lend_id}"
