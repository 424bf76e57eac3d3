"""Every family's greedy text through each path of the in-process engine equal to its text alone
(each prompt on its own, nothing cached: ``model_matrix.TinyModel.alone``), token for token."""

from __future__ import annotations

import pytest

from model_matrix import BLOCK_SIZE, MATRIX, PROMPTS, SHARED_PREFIX, run_engine


@pytest.mark.parametrize("kind", MATRIX)
def test_batched_equals_alone(tiny_model, kind):
    """All prompts in one engine together: their prefills in one step, then their decode rows."""
    tiny = tiny_model(kind)
    assert run_engine(tiny.engine(enable_prefix_caching=False), PROMPTS).tokens == tiny.alone.tokens


@pytest.mark.parametrize("kind", MATRIX)
def test_chunked_prefill_equals_alone(tiny_model, kind):
    """16 tokens a step: the 40- and 48-token prompts prefill in chunks, beside the others' decodes."""
    tiny = tiny_model(kind)
    run = run_engine(tiny.engine(enable_prefix_caching=False, max_num_batched_tokens=16), PROMPTS)
    assert run.tokens == tiny.alone.tokens


@pytest.mark.parametrize("kind", MATRIX)
def test_prefix_hit_equals_alone(tiny_model, kind):
    """The third prompt, run after the second, reads their shared 32 tokens (4 blocks) from the cache."""
    tiny = tiny_model(kind)
    run = run_engine(tiny.engine(), PROMPTS, together=False)
    assert run.num_cached[2] == SHARED_PREFIX and SHARED_PREFIX % BLOCK_SIZE == 0
    assert run.tokens == tiny.alone.tokens


@pytest.mark.parametrize("kind", MATRIX)
def test_preempted_and_resumed_equals_alone(tiny_model, kind):
    """A pool of 9 blocks (72 tokens) holds any one request whole (at most 60 tokens) but not all three
    (82): a running request is preempted, gives its blocks back and is recomputed later. Where every
    layer is windowed a request holds only its window's blocks: 7 blocks (the longest prompt's 6 and
    one), prefilled 16 tokens a step so that all three run at once."""
    tiny = tiny_model(kind)
    if tiny.model.cfg.uniform_window:
        engine = tiny.engine(kv_cache_memory=tiny.blocks_bytes(7), max_num_batched_tokens=16)
    else:
        engine = tiny.engine(kv_cache_memory=tiny.blocks_bytes(9))
    run = run_engine(engine, PROMPTS)
    assert run.num_preemptions > 0
    assert run.tokens == tiny.alone.tokens
