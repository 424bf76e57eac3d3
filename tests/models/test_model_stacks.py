"""Two of the matrix's models served by a real stack with disaggregated prefill (nats-server,
redis-server and `tandem up`'s processes): a dense family of another shape than the Mixtral of
tests/integration/test_families_disagg.py (Qwen3: head_dim 32, not hidden / heads) and a windowed
mixture of experts (gpt-oss: windowed and global layers, sinks, 2 of 8 experts). Each is save_tiny's
model with SmolLM2's tokenizer and vocabulary; its greedy text in float32 equal to the in-process
engine's prefilling locally, with every prompt prefilled remotely and its KV written over NIXL
(test_families_disagg.py's check, run on these models), and when the stream's decode worker is
SIGKILLed mid-stream and the gateway continues it on another (migrated)."""

from __future__ import annotations

import json

import openai
import pytest

from stack_helpers import (greedy_text, reference_engine, remote_prefill_pair, require_nixl, spawn_ready_decode,
                           wait_for)

require_nixl()

from test_families_disagg import ENGINE, MAX_MODEL_LEN  # noqa: E402
from test_families_disagg import (  # noqa: E402 — named so that pytest does not collect it here again
    test_a_windowed_mixture_of_experts_prefilled_remotely_equals_the_local_engine as remote_prefill_equals_local)
from test_stack import metric  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.long]

NUM_MIGRATED_TOKENS = 300  # enough that the stream is still running when its worker is killed


@pytest.fixture(scope="module", params=["qwen3", "gpt_oss"])
def served_model(request, tmp_path_factory):
    """save_tiny's model of the kind with SmolLM2's tokenizer: its vocabulary, BOS and EOS."""
    from loadtest.tools.synth_model import write_hf_tokenizer
    from shared.model.registry import fetch_model
    from tiny_hf_models import save_tiny

    path = tmp_path_factory.mktemp(f"served-{request.param}")
    save_tiny(request.param, path, vocab_size=49152, max_position_embeddings=MAX_MODEL_LEN)
    bos, eos = write_hf_tokenizer(path, fetch_model("smollm2-135m"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"bos_token_id": bos, "eos_token_id": eos}))
    return path


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory, served_model):
    """One decode worker that prefills nothing itself, one prefill worker."""
    with remote_prefill_pair(tmp_path_factory.mktemp("models"), "m", nats_server, redis_server,
                             str(served_model), ENGINE) as s:
        yield s


@pytest.fixture(scope="module")
def engine(served_model):
    with reference_engine(str(served_model), MAX_MODEL_LEN, 32 << 20) as e:
        yield e


def test_remote_prefill_over_nixl_equals_the_local_engine(stack, engine):
    remote_prefill_equals_local(stack, engine)


def test_a_stream_migrated_from_a_killed_worker_equals_the_local_engine(stack, engine):
    """A second decode worker takes the stream; SIGKILLed after its first tokens, the gateway continues
    the request on the first worker from the prompt and the tokens generated so far."""
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=180)
    model = client.models.list().data[0].id
    victim, victim_id = spawn_ready_decode(stack, "decode-0-victim")
    migrations = metric(stack, "tandem_gateway_migrations_total")
    prompt = "Here is a long list of fruits and vegetables:"
    expected = greedy_text(engine, engine.tokenizer.encode(prompt), NUM_MIGRATED_TOKENS, ignore_eos=True)
    text, usage = "", None
    response = stream_on(client, model, victim_id, prompt)
    try:
        for i, chunk in enumerate(response.parse()):
            if i == 3:
                victim.kill()
            text += "".join(choice.text for choice in chunk.choices)
            usage = chunk.usage or usage
    finally:
        response.close()
    assert text == expected
    assert usage.completion_tokens == NUM_MIGRATED_TOKENS
    assert metric(stack, "tandem_gateway_migrations_total") == migrations + 1


def stream_on(client, model: str, worker_id: str, prompt: str):
    """A streamed greedy completion's response (to close) the gateway admitted to ``worker_id``, opened
    until one is: a new worker wins the routing tie once admission's view lists it."""
    def attempt():
        response = client.completions.with_streaming_response.create(
            model=model, prompt=prompt, max_tokens=NUM_MIGRATED_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}).__enter__()
        if response.headers.get("x-tandem-worker") == worker_id:
            return response
        response.close()
        return None

    return wait_for(attempt, 30, f"a stream admitted to {worker_id}")
