"""Redis access (the kv-index's prefix ownership) and the one module that forms Redis keys."""

from shared.store.keys import RedisKeys
from shared.store.kv_index import KvIndexStore, connect

__all__ = ["KvIndexStore", "RedisKeys", "connect"]
