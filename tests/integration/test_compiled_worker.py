"""A decode worker that compiles its decode step in the background (the workers' default, pinned
off for the other tests): it is ready and answers before the graph is, ``/status`` then shows its
decode step ``compiled``, and the greedy text is the in-process eager engine's (float32, real
SmolLM2, real nats-server and redis-server). It publishes what it compiled to the cluster, and a
second worker on "another machine" (an empty compile cache) compiles nothing: it loads the step
from the cluster's artifacts (shared/engine/compiled/artifacts.py) and answers with the same text."""

from __future__ import annotations


import openai
import pytest

from stack_helpers import (child_lines, cluster_status, greedy_text, reference_engine, running_stack,
                           spawn_ready_decode, stack_spec, wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.long]

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 1024
MESSAGES = [{"role": "user", "content": "Write two sentences about a lighthouse keeper."}]


def decode_steps(stack) -> dict[str, str | None]:
    return {w["info"]["worker_id"]: (w["load"] or {}).get("decode_step") for w in cluster_status(stack)["workers"]}


def test_worker_serves_eagerly_then_compiled_with_the_same_text(nats_server, redis_server, tmp_path, monkeypatch):
    """Over a minute: two workers start one after the other, and the first compiles or loads its step."""
    spec = stack_spec(tmp_path, "c", nats_server, redis_server, num_decode=1, model=MODEL,
                      decode_flags={"max_model_len": MAX_MODEL_LEN, "kv_cache_memory": "128MiB", "device": "cpu",
                                    "num_warmup_requests": 1, "compile": "background"})
    with reference_engine(MODEL, MAX_MODEL_LEN, 128 << 20) as engine, running_stack(spec) as stack:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        tok = engine.tokenizer
        expected = greedy_text(engine, tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True)), 32)

        def ask() -> str:
            reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32, temperature=0)
            return reply.choices[0].message.content

        assert ask() == expected  # eager, or compiled already if inductor's disk cache had the graph
        # a cold compile takes minutes on 2 cores; the worker reports its step about once a second
        wait_for(lambda: set(decode_steps(stack).values()) == {"compiled"}, 900, "the worker's compiled step")
        assert ask() == expected
        assert any("compiled decode step ready after" in line for line in stack.lines)

        # the cluster had no artifacts under this namespace: the first worker publishes its own
        wait_for(lambda: any("published to the cluster" in line for line in stack.lines), 300, "the artifacts")
        monkeypatch.setenv("TANDEM_COMPILE_CACHE_DIR", str(tmp_path / "another-machine"))
        _, second = spawn_ready_decode(stack, "decode-2", timeout_s=600)
        wait_for(lambda: decode_steps(stack).get(second) == "compiled", 600, "the second worker's compiled step")
        theirs = child_lines(stack, "decode-2")
        assert any("fetched from the cluster" in line for line in theirs), theirs[-20:]
        assert any("loaded, compiled ahead of time," in line for line in theirs), theirs[-20:]
        assert ask() == expected and ask() == expected
