"""A mixture-of-experts model with a sliding window served by a real stack with disaggregated
prefill: a random-weight Mixtral (2 layers, 4 experts, top 2, every layer windowed to 24 tokens),
saved as a Hugging Face directory with SmolLM2's tokenizer, behind `tandem up`'s processes; every
prompt is prefilled by the prefill worker and its KV written over NIXL into the decode worker,
which then frees the blocks that leave the window as it decodes. Greedy text equal to the same
model's in-process engine prefilling locally (float32), prompts shorter and longer than the window."""

from __future__ import annotations

import platform

import openai
import pytest

from stack_helpers import greedy_text, reference_engine, remote_prefill_pair, wait_for

if platform.system() != "Linux":
    pytest.skip("NIXL (nixl-cu12) is a dependency on Linux only", allow_module_level=True)

from test_disagg import worker_load  # noqa: E402 — NIXL checked there too

pytestmark = [pytest.mark.slow, pytest.mark.long]

MAX_MODEL_LEN = 1024
WINDOW = 24
ENGINE = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory": "32MiB", "device": "cpu", "dtype": "float32",
          "num_warmup_requests": 1, "block_size": 16}


@pytest.fixture(scope="module")
def windowed_moe(tmp_path_factory):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from loadtest.tools.synth_model import write_hf_tokenizer
    from shared.model.registry import fetch_model

    path = tmp_path_factory.mktemp("mixtral-window")
    bos, eos = write_hf_tokenizer(path, fetch_model("smollm2-135m"))
    config = MixtralConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           sliding_window=WINDOW, max_position_embeddings=MAX_MODEL_LEN, bos_token_id=bos,
                           eos_token_id=eos, tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(7)
    MixtralForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def stack(nats_server, redis_server, tmp_path_factory, windowed_moe):
    with remote_prefill_pair(tmp_path_factory.mktemp("families"), "f", nats_server, redis_server,
                             str(windowed_moe), ENGINE) as s:
        yield s


@pytest.fixture(scope="module")
def engine(windowed_moe):
    with reference_engine(str(windowed_moe), MAX_MODEL_LEN, 32 << 20) as e:
        yield e


def test_a_windowed_mixture_of_experts_prefilled_remotely_equals_the_local_engine(stack, engine):
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=180)
    model = client.models.list().data[0].id
    before = worker_load(stack, "decode")
    prompts = ["Name three colours that a child might see in the sky at noon on a clear day:",  # 1 block, in the window
               "A steam engine boils water in a closed boiler; the steam pushes a piston back and forth, and "
               "a crank turns that motion into the rotation of a wheel. Say what turns the wheel:"]
    for i, prompt in enumerate(prompts):
        ids = engine.tokenizer.encode(prompt)
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=2 * WINDOW, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert reply.usage.prompt_tokens == len(ids)
        assert reply.choices[0].text == greedy_text(engine, ids, 2 * WINDOW, ignore_eos=True), prompt
        wait_for(lambda: worker_load(stack, "decode")["num_remote_prefills"] >= before["num_remote_prefills"] + i + 1,
                 what="the decode worker's load report to count the remote prefill")
    load = worker_load(stack, "decode")
    assert load["num_local_prefills"] == before["num_local_prefills"]
    assert load["kv_bytes_received"] > before["kv_bytes_received"]
