"""Metrics and the dashboard on a real stack: gateway, admission, kv-index, autoscaler, one decode
and one prefill worker as separate processes (real model, NATS, Redis, NIXL over DRAM).

Every service publishes its metrics address in the service directory; ``/status`` and
``tandem status`` list them; each ``/metrics`` parses with the Prometheus text parser and carries
its families, with values that moved for the requests sent. The dashboard is driven in headless
Chromium (``browser`` marker)."""

from __future__ import annotations

import asyncio
import json
import math
import platform
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.telemetry.metrics import sample_total
from browser import chromium_page, find_chromium
from stack_helpers import cluster_status, running_stack, stack_spec, tool_missing, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
ENGINE = {"max_model_len": 1024, "kv_cache_memory": "96MiB", "device": "cpu", "num_warmup_requests": 1}
LONG = "Prefill workers compute the KV of long prompts and write it into decode workers. " * 12
SCREENSHOT = Path(__file__).resolve().parents[2] / "loadtest" / "results" / "dashboard.png"

EXPECTED = {  # service → families it must export (beside process_* and tandem_service_*)
    "gateway": {"tandem_gateway_requests", "tandem_gateway_ttft_seconds", "tandem_gateway_itl_seconds",
                "tandem_gateway_e2e_seconds", "tandem_gateway_admitted", "tandem_gateway_in_flight"},
    "admission": {"tandem_admission_decisions", "tandem_admission_decision_seconds",
                  "tandem_admission_ready_decode_workers"},
    "kv-index": {"tandem_kvindex_events", "tandem_kvindex_matches", "tandem_kvindex_match_seconds"},
    "autoscaler": {"tandem_cluster_workers", "tandem_prefill_queue_depth", "tandem_prefill_queue_in_progress"},
    "decode": {"tandem_worker_kv_cache_usage_ratio", "tandem_worker_prefix_hit_ratio",
               "tandem_worker_running_requests", "tandem_worker_waiting_requests", "tandem_engine_batch_size",
               "tandem_engine_step_seconds", "tandem_worker_ttft_seconds", "tandem_worker_requests",
               "tandem_worker_prefills", "tandem_kv_transfer_bytes", "tandem_worker_info"},
    "prefill": {"tandem_prefill_queue_wait_seconds", "tandem_prefill_compute_seconds", "tandem_kv_transfer_seconds",
                "tandem_kv_transfer_bytes", "tandem_engine_step_seconds", "tandem_worker_kv_cache_usage_ratio"},
}


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    if platform.system() != "Linux":
        pytest.skip("the prefill worker needs NIXL (nixl-cu12), a dependency on Linux only")
    spec = stack_spec(tmp_path_factory.mktemp("observability"), "o", nats_server, redis_server, num_decode=1,
                      num_prefill=1, model=MODEL, registry_ttl_s=3.0,
                      decode_flags={**ENGINE, "max_local_prefill_tokens": 64}, prefill_flags=ENGINE)
    with running_stack(spec, ready_timeout_s=240) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def send_requests(client, num: int) -> None:
    """Short prompts prefill on the decode worker; the long one goes through the prefill worker."""
    for i in range(num):
        prompt = LONG if i == 0 else f"Count to {i + 3}:"
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def families(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


def published_services(stack) -> dict[str, str]:
    """service → metrics URL, once all six services have published theirs."""
    found: dict[str, str] = {}

    def all_there():
        found.clear()
        found.update({s["service"]: s["metrics_url"] for s in cluster_status(stack).get("services", [])})
        return set(found) >= set(EXPECTED)

    try:
        wait_for(all_there, 30, f"metrics addresses of {sorted(EXPECTED)} in /status")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; missing: {sorted(set(EXPECTED) - set(found))}") from None
    return dict(found)


def test_every_service_serves_metrics_that_parse(stack, client, capsys):
    send_requests(client, 4)
    urls = published_services(stack)
    assert len(set(urls.values())) == len(urls), f"two services share a metrics address: {urls}"
    for service, wanted in EXPECTED.items():
        names = families(scrape(urls[service]))  # raises on anything the parser cannot read
        missing = (wanted | {"tandem_service_info", "tandem_service_restarts", "process_cpu_seconds"}) - names
        assert not missing, f"{service} ({urls[service]}) lacks {sorted(missing)}"
    gateway = scrape(urls["gateway"])
    assert sample_total(gateway, "tandem_gateway_ttft_seconds_count") >= 4
    assert sample_total(gateway, "tandem_gateway_e2e_seconds_count") >= 4
    admission = scrape(urls["admission"])
    assert sample_total(admission, "tandem_admission_decisions_total", decision="admitted") >= 4
    # only the long prompt fills a block: the short ones have no hashes to match
    assert sample_total(scrape(urls["kv-index"]), "tandem_kvindex_matches_total") >= 1
    prefill = scrape(urls["prefill"])
    assert sample_total(prefill, "tandem_prefill_queue_wait_seconds_count") >= 1
    assert sample_total(prefill, "tandem_kv_transfer_bytes_total", direction="sent") > 0
    decode = scrape(urls["decode"])
    assert sample_total(decode, "tandem_engine_batch_size_count") > 0
    assert sample_total(decode, "tandem_kv_transfer_bytes_total", direction="received") > 0
    wait_for(lambda: sample_total(scrape(urls["decode"]), "tandem_worker_prefills_total", kind="remote"), 10,
             "the decode worker's load report counting the remote prefill")

    from services.cli import main

    assert main(["status", "--url", stack.base_url]) == 0
    out = capsys.readouterr().out
    for service, url in urls.items():
        assert any(line.split()[:1] == [service] and line.endswith(url) for line in out.splitlines()), \
            f"tandem status does not list {service} at {url}:\n{out}"


def test_dashboard_data_reuses_the_status(stack, client):
    send_requests(client, 2)
    with urllib.request.urlopen(stack.base_url + "/dashboard/data", timeout=10) as resp:
        data = json.load(resp)
    roles = sorted(w["info"]["role"] for w in data["status"]["workers"])
    assert roles == ["decode", "prefill"]
    assert any(p["ttft_p50"] is not None for p in data["series"])
    assert sum(p["tokens_per_s"] for p in data["series"]) > 0


@pytest.mark.browser
def test_dashboard_in_headless_chromium(stack, client, tmp_path):
    binary = find_chromium()
    if binary is None:
        tool_missing("chromium is missing and could not be installed with apt-get (install.sh --chromium)")
    rows = asyncio.run(drive_dashboard(binary, tmp_path / "chromium", stack.base_url, client))
    assert rows == sorted(w["info"]["worker_id"] for w in cluster_status(stack)["workers"])


async def drive_dashboard(binary: str, profile: Path, base_url: str, client) -> list[str]:
    """Load the page, wait for the worker rows, send requests in a fresh history step and wait for
    the charts to draw them; leave a screenshot. Returns the worker ids of the rows."""
    async with chromium_page(binary, profile) as page:
        await page.call("Page.enable")
        await page.call("Page.navigate", url=base_url + "/dashboard")
        rows = await page.wait_for(
            "[...document.querySelectorAll('#workers tr.worker')].map(r => r.dataset.workerId).sort()"
            ".filter((_, i, all) => all.length >= 2)", 30, "two worker rows")
        # earlier tests' requests may sit in the current step: start in the next one
        data = await page.wait_for("window.tandemDashboard.last", 10, "the first update")
        fresh_step = math.floor(data["now"] / data["step_s"]) * data["step_s"] + data["step_s"]
        await page.wait_for(f"window.tandemDashboard.last.now >= {fresh_step}", 30, "the next history step")
        await asyncio.to_thread(send_requests, client, 3)
        for chart in ("chart-ttft", "chart-itl", "chart-throughput"):
            await page.wait_for(f"window.tandemDashboard.chartLastT['{chart}'] >= {fresh_step}", 30,
                                f"{chart} drawing the new requests")
        updates = await page.evaluate("window.tandemDashboard.updates")
        await page.wait_for(f"window.tandemDashboard.updates >= {updates + 2}", 10, "two more updates")
        assert await page.evaluate("window.tandemDashboard.errors") == 0
        assert await page.evaluate("document.getElementById('queue-now').textContent") != ""
        await page.screenshot(SCREENSHOT)
        return rows
