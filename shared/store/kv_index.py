"""The prefix-hash → owners index in Redis (owned by the kv-index service).

Layout (keys from ``RedisKeys``): one hash per block with a ``worker@tier`` field per holder, one
set per worker of the ``hash@tier`` it holds, and bookkeeping (last seq per worker, last stream
seq). Each event batch is applied in one MULTI/EXEC, so a reader never sees half a batch and the
stream position moves together with the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import redis.asyncio as redis
import redis.exceptions as redis_errors

from shared.kvcache.overlap import extend_overlap
from shared.protocol.kv import AllBlocksClearedEvent, BlockRemovedEvent, KvEventBatch
from shared.store.keys import RedisKeys
from shared.telemetry.redact import redact_url

_MATCH_CHUNK = 64  # blocks fetched per round trip while walking a prompt


_TIER_RANK = {"gpu": 0, "host": 1, "disk": 2}  # a block held in several tiers counts as its best


@dataclass(frozen=True)
class TierOverlap:
    num_blocks: int  # leading blocks held, in any tier
    num_host_blocks: int = 0  # of those, held in host memory and not in the pool
    num_disk_blocks: int = 0  # held only on disk


def _overlaps(counts: dict[str, int], lower: dict[str, dict[str, int]]) -> dict[str, TierOverlap]:
    return {w: TierOverlap(n, lower.get(w, {}).get("host", 0), lower.get(w, {}).get("disk", 0))
            for w, n in counts.items()}


def connect(url: str, timeout_s: float | None = None) -> redis.Redis:
    """A client for ``url`` (``redis://[:password@]host:port/db``); it connects on first use.
    ``timeout_s``: how long a connect or a reply may take before redis-py raises a TimeoutError
    (None: 5 s to connect, replies waited for)."""
    return redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=timeout_s or 5,
                                socket_timeout=timeout_s, health_check_interval=30)


async def check_connection(client: redis.Redis, url: str) -> None:
    """Ping Redis once; a refused login or an unreachable server becomes a one-line ConnectionError
    naming ``url`` with its password redacted (redis-py's own says neither which server nor why)."""
    try:
        await client.ping()
    except redis_errors.AuthenticationError:
        why = ("rejected the password" if urlsplit(url).password
               else "requires a password and the URL carries none")
        raise ConnectionError(f"Redis at {redact_url(url)} {why}") from None
    except (redis_errors.ConnectionError, OSError) as exc:
        raise ConnectionError(f"cannot reach Redis at {redact_url(url)}: {exc}") from None


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says Redis is down or restarting (as opposed to a bug)."""
    return isinstance(exc, (redis_errors.ConnectionError, redis_errors.TimeoutError,
                            redis_errors.BusyLoadingError, OSError))


class KvIndexStore:
    def __init__(self, client: redis.Redis, keys: RedisKeys) -> None:
        self._r = client
        self._keys = keys

    async def apply(self, batch: KvEventBatch, stream_seq: int, now: float) -> None:
        k, w = self._keys, batch.worker_id
        for event in batch.events:
            if isinstance(event, AllBlocksClearedEvent):
                await self.drop_worker(w)
        pipe = self._r.pipeline(transaction=True)
        for event in batch.events:
            if isinstance(event, AllBlocksClearedEvent):
                continue
            owner = f"{w}@{event.tier}"
            members = [f"{h}@{event.tier}" for h in event.block_hashes]
            if isinstance(event, BlockRemovedEvent):
                for h in event.block_hashes:
                    pipe.hdel(k.block_owners(h), owner)
                if members:
                    pipe.srem(k.worker_blocks(w), *members)
            else:
                for h in event.block_hashes:
                    pipe.hset(k.block_owners(h), owner, 1)
                if members:
                    pipe.sadd(k.worker_blocks(w), *members)
        pipe.hset(k.workers(), w, now)
        pipe.hset(k.worker_seqs(), w, batch.events[-1].seq)
        pipe.set(k.stream_seq(), stream_seq)
        await pipe.execute()

    async def drop_worker(self, worker_id: str) -> int:
        """Remove every entry of ``worker_id``; returns how many blocks it held."""
        k = self._keys
        members = await self._r.smembers(k.worker_blocks(worker_id))
        pipe = self._r.pipeline(transaction=True)
        for member in members:
            block_hash, _, tier = member.partition("@")
            pipe.hdel(k.block_owners(int(block_hash)), f"{worker_id}@{tier}")
        pipe.delete(k.worker_blocks(worker_id))
        pipe.hdel(k.workers(), worker_id)
        pipe.hdel(k.worker_seqs(), worker_id)
        await pipe.execute()
        return len(members)

    async def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each worker, how many leading blocks of ``block_hashes`` it holds (any tier)."""
        return {w: m.num_blocks for w, m in (await self.match_tiers(block_hashes)).items()}

    async def match_tiers(self, block_hashes: Sequence[int]) -> dict[str, TierOverlap]:
        """For each worker, how many leading blocks of ``block_hashes`` it holds in any tier, and
        how many of those it holds only below its pool (host memory, disk).

        Walks (``extend_overlap``) in pipelined chunks and stops at the first block no
        still-matching worker holds."""
        counts: dict[str, int] = {}
        lower: dict[str, dict[str, int]] = {}
        for start in range(0, len(block_hashes), _MATCH_CHUNK):
            pipe = self._r.pipeline(transaction=False)
            for h in block_hashes[start:start + _MATCH_CHUNK]:
                pipe.hkeys(self._keys.block_owners(h))
            for i, fields in enumerate(await pipe.execute(), start=start):
                best: dict[str, str] = {}
                for f in fields:
                    worker, _, tier = f.partition("@")
                    if worker not in best or _TIER_RANK.get(tier, 0) < _TIER_RANK.get(best[worker], 0):
                        best[worker] = tier
                if not extend_overlap(counts, i, best):
                    return _overlaps(counts, lower)
                for worker, tier in best.items():
                    if counts[worker] == i + 1 and tier in ("host", "disk"):
                        held = lower.setdefault(worker, {})
                        held[tier] = held.get(tier, 0) + 1
        return _overlaps(counts, lower)

    async def owners(self, block_hash: int) -> set[str]:
        return {f.partition("@")[0] for f in await self._r.hkeys(self._keys.block_owners(block_hash))}

    async def workers(self) -> dict[str, float]:
        """Workers with entries → time of their last applied event."""
        return {w: float(t) for w, t in (await self._r.hgetall(self._keys.workers())).items()}

    async def worker_seqs(self) -> dict[str, int]:
        return {w: int(s) for w, s in (await self._r.hgetall(self._keys.worker_seqs())).items()}

    async def mark_built(self, is_built: bool = True) -> None:
        if is_built:
            await self._r.set(self._keys.index_built(), 1)
        else:
            await self._r.delete(self._keys.index_built())

    async def is_built(self) -> bool:
        """False once Redis lost the index (restarted: it keeps no data) until ``mark_built``."""
        return bool(await self._r.exists(self._keys.index_built()))

    async def stream_seq(self) -> int:
        return int(await self._r.get(self._keys.stream_seq()) or 0)
