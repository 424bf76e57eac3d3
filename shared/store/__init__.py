"""Redis access (the kv-index's prefix ownership) and the one module that forms Redis keys."""

from shared.store.keys import RedisKeys
from shared.store.kv_index import KvIndexStore, check_connection, connect, is_unavailable

__all__ = ["KvIndexStore", "RedisKeys", "check_connection", "connect", "is_unavailable"]
