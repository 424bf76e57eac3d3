"""A tensor-parallel decode worker in a real stack: SmolLM2 (float32) at TP=3, three processes that
register as one worker beside an ordinary one, serving streamed chat with the in-process greedy
text; one of its ranks SIGKILLed mid-stream: the stream finishes on the other worker with the same
text, the group's entry leaves the registry, and none of its rank processes is left behind. And a
plan file (``tandem up --plan``) started as written: a TP=3 and a PP=2 decode worker."""

from __future__ import annotations

import json
import os
import uuid
from http.client import HTTPConnection

import pytest

from services.up.config import UpSettings
from services.up.service import spec_from_settings
from shared.model.shm_collectives import is_alive
from stack_helpers import (cluster_status, greedy_text, read_events, reference_engine_fixture, running_stack,
                           spawn_ready_decode, stack_spec, wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 1024
TTL_S = 3.0


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory):
    spec = stack_spec(tmp_path_factory.mktemp("stack"), "tp", nats_server, redis_server, num_decode=1, model=MODEL,
                      registry_ttl_s=TTL_S,
                      decode_flags={"max_model_len": MAX_MODEL_LEN, "kv_cache_memory": "64MiB",
                                    "device": "cpu", "num_warmup_requests": 1, "drain_timeout_s": 30})
    with running_stack(spec, ready_timeout_s=180) as s:
        yield s


engine = reference_engine_fixture(MODEL, MAX_MODEL_LEN, 64 << 20)


def worker_info(stack, worker_id: str) -> dict | None:
    return next((w["info"] for w in cluster_status(stack)["workers"] if w["info"]["worker_id"] == worker_id), None)


def messages_of(content: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": content}] if isinstance(content, str) else content


def stream_chat(stack, content: str | list[dict], max_tokens: int):
    conn = HTTPConnection("127.0.0.1", stack.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": MODEL, "messages": messages_of(content), "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.connection = conn
    return resp


def stream_on(stack, worker_id: str, content: str | list[dict], max_tokens: int):
    """A streamed chat admitted to ``worker_id`` (one that lands elsewhere is closed and sent again)."""
    def attempt():
        resp = stream_chat(stack, content, max_tokens)
        if resp.getheader("X-Tandem-Worker") == worker_id:
            return resp
        resp.connection.sock.shutdown(2)
        resp.connection.close()
        return None

    return wait_for(attempt, 60, f"a stream admitted to {worker_id}")


def text_of(events: list[dict]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


def test_a_group_serves_as_one_worker_and_a_dead_rank_loses_no_request(stack, engine):
    """Can take over a minute on 2 cores: the stack, the in-process reference engine and the group's
    three rank processes all load the model."""
    _, group_id = spawn_ready_decode(stack, "decode-0-tp3", flags={"tensor_parallel_size": 3})
    info = worker_info(stack, group_id)
    assert info["tensor_parallel_size"] == 3 and len(info["rank_pids"]) == 2
    pids = [info["pid"], *info["rank_pids"]]
    assert all(is_alive(p) for p in pids)

    tok = engine.tokenizer
    content = "Write a list of ten animals that live in the sea, one per line."
    chat_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True))
    expected = greedy_text(engine, chat_ids, 32, ignore_eos=True)
    assert text_of(read_events(stream_on(stack, group_id, content, 32))) == expected

    resp = stream_on(stack, group_id, content, 32)
    events = read_events(resp, 4)
    os.kill(info["rank_pids"][0], 9)  # one follower rank: the group breaks at its next step
    events += read_events(resp)
    assert text_of(events) == expected  # finished on the other worker from the tokens it had
    wait_for(lambda: not any(is_alive(p) for p in pids), 30, f"every rank process of {group_id} gone")
    wait_for(lambda: (worker_info(stack, group_id) or {}).get("pid") != info["pid"], 4 * TTL_S,
             f"{group_id}'s broken group gone from the registry")


def test_a_plan_file_starts_its_workers_as_written(nats_server, redis_server, tmp_path, engine, plan_file):
    path = plan_file([("decode-0", "decode", ["host/gpu0", "host/gpu1", "host/gpu2"], 3, 1),
                      ("decode-1", "decode", ["host/gpu3", "host/gpu4"], 1, 2)],
                     slo={"ttft_s": 5.0, "tpot_s": 0.5}, output_tokens_per_s=10.0, predicted_ttft_s=1.0,
                     predicted_tpot_s=0.1)
    settings = UpSettings(plan=path, model=MODEL, device="cpu", port=0, namespace=f"plan{uuid.uuid4().hex[:6]}",
                          nats_url=nats_server.url, redis_url=redis_server.url, state_dir=tmp_path / "state",
                          kv_cache_memory="32MiB")  # the default registry TTL: five rank processes share 2 cores
    spec = spec_from_settings(settings)
    assert (spec.num_decode, spec.num_prefill) == (2, 0)
    assert spec.worker_flags == {"decode-1": {"tensor_parallel_size": 3}, "decode-2": {"pipeline_parallel_size": 2}}
    with running_stack(spec, ready_timeout_s=180) as stack:
        def shapes():
            return {w["info"]["worker_id"].removeprefix(f"{spec.namespace}-"):
                    (w["info"]["tensor_parallel_size"], w["info"]["pipeline_parallel_size"], len(w["info"]["rank_pids"]))
                    for w in cluster_status(stack)["workers"]}

        # both listed at once: on a loaded machine a worker's entry can lapse for a beat between refreshes
        wait_for(lambda: shapes() == {"decode-1": (3, 1, 2), "decode-2": (1, 2, 1)}, 60,
                 "the planned shapes in /status")
        # decode-1 wins the routing tie between idle workers, so decode-2 is reached while decode-1
        # streams; the two chats share no KV block (their system messages differ from the first
        # tokens), so no cached prefix pulls either one to a worker
        tok = engine.tokenizer
        chats = {"decode-1": ([{"role": "system", "content": "Answer at length."},
                               {"role": "user", "content": "Describe the sea."}], 128),
                 "decode-2": ([{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Name three colours of the rainbow."}], 16)}
        expected = {name: greedy_text(engine, tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True)),
                                      n, ignore_eos=True) for name, (msgs, n) in chats.items()}
        busy = stream_on(stack, f"{spec.namespace}-decode-1", *chats["decode-1"])
        first = read_events(busy, 2)
        second = stream_on(stack, f"{spec.namespace}-decode-2", *chats["decode-2"])
        assert text_of(read_events(second)) == expected["decode-2"]
        assert text_of(first + read_events(busy)) == expected["decode-1"]
