"""kv-index while its Redis is down: a match is a ``rejected`` error reply (admission then routes on
load), said in one warning for the outage rather than a traceback for every lookup."""

from __future__ import annotations

import asyncio
import logging

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from services.kv_index.config import KvIndexSettings
from services.kv_index.service import KvIndexService
from shared.bus.errors import ServiceError
from shared.protocol import KvMatchRequest


class FlakyStore:
    def __init__(self) -> None:
        self.down = True

    async def match_tiers(self, block_hashes):
        if self.down:
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        return {}


def test_matches_while_redis_is_down_are_rejected_with_one_warning(caplog):
    store = FlakyStore()
    service = KvIndexService(KvIndexSettings(), bus=None, store=store, registry=None)
    request = KvMatchRequest(block_hashes=["00" * 8])
    with caplog.at_level(logging.INFO, logger="services.kv_index.service"):
        for _ in range(3):
            with pytest.raises(ServiceError) as refused:
                asyncio.run(service.match(request))
            assert refused.value.code == "rejected" and "Redis is not answering" in refused.value.message
        store.down = False
        assert asyncio.run(service.match(request)).overlaps == []
    said = [r for r in caplog.records if "Redis" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING", "INFO"], [r.getMessage() for r in said]
    assert not any(r.exc_info for r in caplog.records)


def test_a_bug_in_a_match_still_raises_as_it_is():
    class Broken:
        async def match_tiers(self, block_hashes):
            raise KeyError("not a Redis outage")

    service = KvIndexService(KvIndexSettings(), bus=None, store=Broken(), registry=None)
    with pytest.raises(KeyError):
        asyncio.run(service.match(KvMatchRequest(block_hashes=["00" * 8])))
