"""A service's metrics site and its entry in the service directory, on a real nats-server: the
address is published while the service runs, answers with a parseable exposition, and is gone
when the service stops (or stops beating: the bucket's TTL)."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from services.framework.lifecycle import published_metrics
from services.framework.settings import ServiceSettings
from services.stack.waiting import wait_until
from shared.bus import ServiceDirectory
from shared.protocol import ServiceInfo, Subjects
from shared.telemetry.metrics import sample_total, service_registry


async def test_metrics_address_is_published_served_and_withdrawn(bus, nats_url, namespace):
    settings = ServiceSettings(nats_url=nats_url, namespace=namespace, registry_ttl_s=3.0, num_restarts=2)
    directory = await ServiceDirectory.open(bus, Subjects(namespace).services_bucket, ttl_s=3.0)
    registry = service_registry("admission", "admission-1", settings.num_restarts)
    async with published_metrics("admission", "admission-1", settings, bus, registry) as url:
        entries = await wait_until(directory.list, timeout_s=5, what="the directory entry")
        assert [(e.service, e.instance_id, e.metrics_url, e.num_restarts) for e in entries] == [
            ("admission", "admission-1", url, 2)]
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
            text = await resp.text()
        assert "tandem_service_info" in {f.name for f in text_string_to_metric_families(text)}
        assert sample_total(text, "tandem_service_restarts_total") == 2
    assert await directory.list() == []


async def test_an_entry_without_heartbeat_expires(bus, namespace):
    directory = await ServiceDirectory.open(bus, Subjects(namespace).services_bucket, ttl_s=1.0)
    await directory.put(ServiceInfo(instance_id="gone-1", service="kv-index", metrics_url="http://h:1/metrics"))
    assert [e.instance_id for e in await directory.list()] == ["gone-1"]

    async def expired():
        return await directory.list() == []

    await wait_until(expired, timeout_s=10, what="the entry expiring after its 1s TTL")
