"""A decode worker with a disk KV tier on a real Stack (real SmolLM2, NATS, Redis, kv-index): it
drains, exits and starts again on the same directory; the restarted worker announces its disk
blocks to the index (routing sees them as tier ``disk``), and the same prompt is served with its
prefix from disk and the same greedy text."""

from __future__ import annotations

import json
import signal
import urllib.request

import pytest

from shared.store import RedisKeys, connect
from stack_helpers import cluster_status, running_stack, spawn_ready_decode, stack_spec, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
PROMPT = "Explain, step by step, how a steam engine turns heat into motion. " * 20  # ~300 tokens


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    spec = stack_spec(tmp_path_factory.mktemp("tiers"), "t", nats_server, redis_server, num_decode=1, model=MODEL,
                      registry_ttl_s=3.0, restart_children=False,
                      decode_flags={"max_model_len": 1024, "kv_cache_memory": "64MiB", "device": "cpu",
                                    "num_warmup_requests": 1, "drain_timeout_s": 10,
                                    "kv_disk_dir": str(tmp_path_factory.mktemp("kv-disk")),
                                    "kv_disk_min_uses": 1})
    with running_stack(spec, ready_timeout_s=180) as s:
        yield s


def complete(stack) -> dict:
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(stack.base_url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)


async def disk_blocks_in_index(redis_url: str, namespace: str, worker_id: str) -> int:
    client = connect(redis_url)
    try:
        members = await client.smembers(RedisKeys(namespace).worker_blocks(worker_id))
        return sum(1 for m in members if m.endswith("@disk"))
    finally:
        await client.aclose()


def test_a_restarted_worker_serves_its_prefix_from_disk(stack, redis_server):
    import asyncio

    first = complete(stack)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    name = "decode-1"
    worker_id = stack.worker_id(name)
    child = stack.children[name]
    child.proc.send_signal(signal.SIGTERM)  # drain: the pool's blocks are written to disk on the way out
    child.proc.wait(timeout=60)
    assert child.proc.returncode == 0

    spawn_ready_decode(stack, name)
    # the new process announced the blocks it found on disk; kv-index holds them as tier disk
    wait_for(lambda: asyncio.run(disk_blocks_in_index(redis_server.url, stack.spec.namespace, worker_id)) >= 16,
             30, "the restarted worker's disk blocks in the index")
    tiers = next(w["load"]["kv_tiers"] for w in wait_for(
        lambda: [w for w in cluster_status(stack)["workers"] if (w.get("load") or {}).get("kv_tiers")],
        15, "a load report with kv_tiers"))
    assert tiers["disk_blocks"] >= 16

    second = complete(stack)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 16
    status = wait_for(lambda: [w for w in cluster_status(stack)["workers"]
                               if ((w.get("load") or {}).get("kv_tiers") or {}).get("onboarded_disk")],
                      15, "a load report counting blocks onboarded from disk")
    assert status[0]["load"]["kv_tiers"]["disk_read_failures"] == 0
