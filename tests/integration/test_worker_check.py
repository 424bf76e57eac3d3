"""``tandem worker-check`` against live workers on a real nats-server: the documented echo worker
passes every check it can be asked (it serves no control subject, so drain is skipped), a correct
text worker passes with the text requests the gateway would send it, and a deliberately broken
worker fails each check with the reason that names its fault (but not for a KV namespace that is
not hex: the gateway serves such a worker, routed on load). The real decode worker on the real
model passes too, drain included (tests/integration/test_stack.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.commands.worker_check import check_worker
from shared.bus import WorkerRegistry
from shared.protocol import Subjects, WorkerInfo

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "echo_worker.py"
TTL_S = 3.0
NOT_HEX = "m\x1f\x1f"  # the engine's KV namespace for model "m", sent as text instead of hex


def outcomes(checks) -> dict[str, tuple[str, str]]:
    return {c.name: (c.outcome, c.reason) for c in checks}


async def test_the_echo_worker_passes(nats_url, namespace, bus):
    await WorkerRegistry.open(bus, Subjects(namespace).workers_bucket, ttl_s=TTL_S)
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--nats-url", nats_url, "--namespace", namespace,
                             "--worker-id", "echo-ok", "--ttl", str(TTL_S)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "serving" in proc.stdout.readline()
        checks = await check_worker(nats_url, namespace, "echo-ok", prompt=[1, 2, 3], timeout_s=20, drain=True)
    finally:
        proc.kill()
        proc.wait()
    result = outcomes(checks)
    assert {name for name, (outcome, _) in result.items() if outcome == "FAIL"} == set(), result
    assert result["drain and deregistration"][0] == "SKIP"
    assert "note" not in result["registry entry"][1]  # the engine's KV namespace
    assert result["cancel honoured"][0] == result["load reports"][0] == "PASS"


class BrokenWorker:
    """Registers once and never again (with its KV namespace as text, not hex), skips chunk index 1
    (in short requests), ignores cancels, never answers a malformed request, reports no load."""

    def __init__(self, nc, subjects: Subjects, worker_id: str) -> None:
        self.nc, self.subjects, self.worker_id = nc, subjects, worker_id
        self.tasks: set[asyncio.Task] = set()

    async def start(self, registry: WorkerRegistry) -> None:
        generate = self.subjects.decode_generate(self.worker_id).subject
        cancel = self.subjects.decode_cancel(self.worker_id).subject

        async def on_generate(msg) -> None:
            task = asyncio.create_task(self.serve(msg))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

        async def ignore(msg) -> None:
            pass

        await self.nc.subscribe(generate, cb=on_generate)
        await self.nc.subscribe(cancel, cb=ignore)
        await registry.put(WorkerInfo(worker_id=self.worker_id, role="decode", model="m", block_size=4,
                                      max_model_len=128, generate_subject=generate, cancel_subject=cancel,
                                      kv_namespace_hex=NOT_HEX, started_at=time.time()))

    async def serve(self, msg) -> None:
        try:
            req = json.loads(msg.data)
            rid, n = req["request_id"], req["sampling"]["max_tokens"]
        except (KeyError, TypeError, ValueError):
            return  # no error reply
        for i in range(n):
            index = i + 1 if i and n <= 16 else i  # 0, 2, 3, ...: chunk 1 is missing
            await self.nc.publish(msg.reply, json.dumps({
                "request_id": rid, "index": index, "token_ids": [5],
                "finish_reason": "length" if i == n - 1 else None}).encode())
            await asyncio.sleep(0.002)
        await self.nc.publish(msg.reply, b"", headers={"Tandem-Stream": "end"})


async def test_a_broken_worker_fails_each_check_for_its_own_fault(nats_url, namespace, bus):
    subjects = Subjects(namespace)
    registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=TTL_S)
    await BrokenWorker(bus.nc, subjects, "broken-1").start(registry)
    checks = await check_worker(nats_url, namespace, "broken-1", prompt=[1, 2, 3], timeout_s=3)
    result = outcomes(checks)
    assert result["registry entry"][0] == "PASS", result  # served by the gateway: a note, not a failure
    assert f"note: kv_namespace_hex {NOT_HEX!r} is not hex" in result["registry entry"][1]
    assert "routes this worker's requests on load alone" in result["registry entry"][1]
    assert result["heartbeat"] == ("FAIL", "no new put within the bucket's TTL (3s): the entry will expire")
    assert result["streamed generation"] == ("FAIL", "chunk index 2 where 1 was due")
    assert result["cancel honoured"][0] == "FAIL"
    assert result["cancel honoured"][1].startswith("all ") and "came after a cancel" in result["cancel honoured"][1]
    assert result["malformed request gets an error reply"] == (
        "FAIL", "no reply to a malformed GenerateRequest (the caller waits out its timeout)")
    assert result["load reports"][0] == "SKIP"
    assert "drain and deregistration" not in result


async def test_a_worker_that_is_not_registered_fails_and_the_rest_is_skipped(nats_url, namespace, bus):
    await WorkerRegistry.open(bus, Subjects(namespace).workers_bucket, ttl_s=TTL_S)
    result = outcomes(await check_worker(nats_url, namespace, "nobody", prompt=[1], timeout_s=3))
    assert result["registry entry"][0] == "FAIL" and "no entry 'nobody'" in result["registry entry"][1]
    assert {outcome for name, (outcome, _) in result.items() if name not in ("registry entry", "heartbeat")} == {"SKIP"}


class TextWorker:
    """A correct text worker (``takes_text``): answers a chat request (``messages``) or a completion
    (``prompt_text``) with text, counting "1", "2", ... a chunk each up to ``max_tokens``; a request
    with token ids, or a malformed one, gets ``bad_request``; honours cancels (ignoring those of
    requests it does not run); heartbeats and reports load."""

    def __init__(self, nc, subjects: Subjects, worker_id: str) -> None:
        self.nc, self.subjects, self.worker_id = nc, subjects, worker_id
        self.requests: list[dict] = []
        self.running: dict[str, asyncio.Event] = {}
        self.tasks: set[asyncio.Task] = set()

    async def start(self, registry: WorkerRegistry) -> None:
        generate = self.subjects.decode_generate(self.worker_id).subject
        cancel = self.subjects.decode_cancel(self.worker_id).subject
        async def on_generate(msg) -> None:
            self._spawn(self.serve(msg))

        await self.nc.subscribe(generate, cb=on_generate)
        await self.nc.subscribe(cancel, cb=self.on_cancel)
        info = WorkerInfo(worker_id=self.worker_id, role="decode", model="remote-llm", block_size=1,
                          max_model_len=8192, max_num_seqs=4, generate_subject=generate, cancel_subject=cancel,
                          takes_text=True, started_at=time.time())
        self._spawn(self.beat(registry, info))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def beat(self, registry: WorkerRegistry, info: WorkerInfo) -> None:
        seq = 0
        while True:
            await registry.put(info.model_copy(update={"heartbeat_at": time.time()}))
            seq += 1
            await self.nc.publish(self.subjects.load("decode", self.worker_id).subject, json.dumps({
                "worker_id": self.worker_id, "role": "decode", "seq": seq, "timestamp": time.time(),
                "num_running": len(self.running), "max_num_seqs": 4}).encode())
            await asyncio.sleep(TTL_S / 3)

    async def on_cancel(self, msg) -> None:
        event = self.running.get(json.loads(msg.data)["request_id"])
        if event is not None:  # a cancel of a request not running (finished, never seen) is ignored
            event.set()

    async def serve(self, msg) -> None:
        try:
            req = json.loads(msg.data)
            rid, max_tokens = req["request_id"], req["sampling"]["max_tokens"]
            if req.get("prompt_token_ids") or not (req.get("messages") or req.get("prompt_text")):
                raise ValueError("a text worker takes messages or prompt_text, not token ids")
        except (KeyError, TypeError, ValueError) as exc:
            await self.nc.publish(msg.reply, json.dumps({"code": "bad_request", "message": str(exc)}).encode(),
                                  headers={"Tandem-Error-Code": "bad_request"})
            return
        self.requests.append(req)
        cancelled = self.running[rid] = asyncio.Event()
        try:
            for i in range(max_tokens):
                finish = "abort" if cancelled.is_set() else "length" if i == max_tokens - 1 else None
                await self.nc.publish(msg.reply, json.dumps({
                    "request_id": rid, "index": i, "text": "" if finish == "abort" else f"{i + 1}\n",
                    "finish_reason": finish, "num_prompt_tokens": 9 if i == 0 else 0}).encode())
                if finish:
                    break
                await asyncio.sleep(0.005)
        finally:
            del self.running[rid]
        await self.nc.publish(msg.reply, b"", headers={"Tandem-Stream": "end"})


async def test_a_text_worker_gets_text_requests_and_passes(nats_url, namespace, bus):
    subjects = Subjects(namespace)
    registry = await WorkerRegistry.open(bus, subjects.workers_bucket, ttl_s=TTL_S)
    worker = TextWorker(bus.nc, subjects, "text-ok")
    await worker.start(registry)
    try:
        checks = await check_worker(nats_url, namespace, "text-ok", prompt=[1, 2, 3], prompt_text="Count to 1000.",
                                    timeout_s=10)
    finally:
        for task in list(worker.tasks):
            task.cancel()
    result = outcomes(checks)
    assert {name for name, (outcome, _) in result.items() if outcome != "PASS"} == set(), result
    assert result["registry entry"][1].startswith("text worker, model 'remote-llm'")
    assert result["streamed generation"][1] == ("chat: 8 chunks of text, finish_reason 'length', end marker; "
                                                "completion: 8 chunks of text, finish_reason 'length', end marker")
    assert "finish_reason 'abort'" in result["cancel honoured"][1]
    sent = worker.requests
    assert [r["messages"] for r in sent[:1]] == [[{"role": "user", "content": "Count to 1000."}]]
    assert sent[1]["prompt_text"] == "Count to 1000." and all(r["prompt_token_ids"] == [] for r in sent)
