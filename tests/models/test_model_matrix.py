"""Every family's tiny model against transformers: greedy text in float32 from its Hugging Face
directory and from its GGUF, equal to transformers' ``generate`` token for token on each prompt
(up to near-ties of the random weights: ``model_matrix.assert_same_greedy``)."""

from __future__ import annotations

import pytest
import torch

from model_matrix import (MATRIX, PROMPTS, WITH_GGUF, assert_same_greedy, engine_config, families_not_covered,
                          run_engine, transformers_greedy)
from shared.engine import LLMEngine
from shared.model.config import FAMILIES
from shared.model.loader import load_model


def test_every_family_the_loader_builds_is_in_the_matrix():
    """A family added to FAMILIES needs a model in tests/models/model_matrix.py's MATRIX (or a reason
    in its NOT_IN_MATRIX); a family with GGUF rules a GGUF, or the reason it has none."""
    assert not families_not_covered()
    for kind, entry in MATRIX.items():
        if FAMILIES[entry.family].gguf is None:
            assert entry.gguf_kind is None, f"{kind}: a GGUF of a family without GGUF rules"
        else:
            assert entry.gguf_kind or entry.no_gguf, f"{kind}: its family has GGUF rules: give gguf_kind or no_gguf"


@pytest.mark.parametrize("kind", MATRIX)
def test_greedy_from_the_directory_equals_transformers_generate(tiny_model, kind):
    tiny = tiny_model(kind)
    assert tiny.model.cfg.architecture == tiny.entry.family
    for prompt, ours, theirs in zip(PROMPTS, tiny.alone.tokens, tiny.reference):
        assert_same_greedy(tiny.hf, prompt, ours, theirs)


@pytest.mark.parametrize("kind", WITH_GGUF)
def test_greedy_from_the_gguf_equals_transformers_generate(tiny_model, kind):
    tiny = tiny_model(kind)
    hf, gguf = tiny.gguf()
    model = load_model(gguf, "gguf", torch.device("cpu"), torch.float32)
    assert model.cfg.architecture == tiny.entry.family
    run = run_engine(LLMEngine(model, engine_config(enable_prefix_caching=False)), PROMPTS, together=False)
    for prompt, ours in zip(PROMPTS, run.tokens):
        assert_same_greedy(hf, prompt, ours, transformers_greedy(hf, prompt))
    if hf is tiny.hf:  # the directory's own model: the directory's text
        assert run.tokens == tiny.alone.tokens
