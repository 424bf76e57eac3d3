"""The one module that forms Redis keys. Every key starts with ``<namespace>:v1:``."""

from __future__ import annotations

import hashlib

from shared.protocol.subjects import DEFAULT_NAMESPACE


class RedisKeys:
    def __init__(self, namespace: str = DEFAULT_NAMESPACE) -> None:
        self._root = f"{namespace}:v1"

    def block_owners(self, block_hash: int) -> str:
        """Hash: field ``<worker>@<tier>`` for each worker holding the block (value: 1)."""
        return f"{self._root}:kv:block:{block_hash}"

    def worker_blocks(self, worker_id: str) -> str:
        """Set of ``<block_hash>@<tier>`` the worker holds (to drop them when it leaves)."""
        return f"{self._root}:kv:worker:{worker_id}"

    def workers(self) -> str:
        """Hash: worker id → time of its last applied event."""
        return f"{self._root}:kv:workers"

    def worker_seqs(self) -> str:
        """Hash: worker id → seq of its last applied event (gap and restart detection)."""
        return f"{self._root}:kv:seqs"

    def stream_seq(self) -> str:
        """The JetStream sequence of the last applied event batch (where a restart resumes)."""
        return f"{self._root}:kv:stream_seq"

    def index_built(self) -> str:
        """Set once the index is built from the event stream; its absence tells a Redis that lost
        its data (restarted without persistence) from one that holds the index."""
        return f"{self._root}:kv:built"

    def rate_bucket(self, client_id: str) -> str:
        """Hash: the token bucket of one API key (or client address) shared by every gateway
        (fields ``tokens`` and ``at_us``; expires once full again). The id is hashed: an API key
        never reaches Redis."""
        digest = hashlib.sha256(client_id.encode()).hexdigest()[:32]
        return f"{self._root}:rate:{digest}"

    def all_prefix(self) -> str:
        return f"{self._root}:"
