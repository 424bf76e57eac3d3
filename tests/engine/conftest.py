"""The real SmolLM2-135M-Instruct, loaded once per session: ours and transformers' reference."""

from __future__ import annotations

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine
from shared.model.loader import load_model
from shared.tokenizer import Tokenizer

QUESTIONS = [
    "What is the capital of France?",
    "hi",
    "Write a short poem about the sea and the wind.",
    "List three prime numbers and explain why each one is prime. " * 12,  # ~250 tokens
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="session")
def smol_model(smollm2_gguf):
    return load_model(smollm2_gguf, "gguf", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def smol_tokenizer(smollm2_gguf):
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def hf_smol(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def chat_prompts(smol_tokenizer):
    tok = smol_tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="session")
def make_engine(smol_model, smol_tokenizer):
    def make(**kw):
        kw.setdefault("kv_cache_memory", 64 << 20)
        return LLMEngine(smol_model, EngineConfig(**kw), tokenizer=smol_tokenizer, model_id="smollm2-135m",
                         eos_token_ids=frozenset(smol_tokenizer.stop_token_ids))
    return make
