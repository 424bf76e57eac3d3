"""Host and disk KV tiers on the real model: a prefix evicted from the pool comes back from host
memory or disk (or from disk after a restart) and the greedy output equals a cold run's; a damaged
block on disk is recomputed, never used."""

from __future__ import annotations

import pytest

from shared.engine import SamplingParams
from shared.kvcache.events import BlockStored, ListSink
from shared.kvcache.hashing import hash_blocks

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
POOL = 40 * 737280  # 40 blocks of 16 float32 tokens: two long prompts do not fit together


@pytest.fixture(scope="module")
def long_prompts(smol_tokenizer):
    tok = smol_tokenizer
    texts = ["List three prime numbers and explain why each one is prime. " * 24,
             "Describe how a bicycle works, from the pedals to the wheels. " * 24]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


@pytest.fixture(scope="module")
def cold(make_engine, long_prompts):
    """Greedy outputs with no tiers and nothing cached."""
    return [make_engine(kv_cache_memory=POOL).generate([p], GREEDY)[0] for p in long_prompts]


def run(engine, prompt):
    before = engine.stats()
    out = engine.generate([prompt], GREEDY)[0]
    return out, engine.stats().num_cached_prompt_tokens - before.num_cached_prompt_tokens


def test_host_tier_onboards_an_evicted_prefix(make_engine, long_prompts, cold):
    a, b = long_prompts
    engine = make_engine(kv_cache_memory=POOL, kv_host_memory=64 << 20)
    assert run(engine, a)[0] == cold[0]
    assert run(engine, b)[0] == cold[1]
    assert engine.tiers.counters.offloaded_host > 0, "running b should have evicted a's blocks to host"
    out, cached = run(engine, a)
    assert out == cold[0]
    assert cached >= (len(a) - 1) // 16 * 16 - 16, "a's prefix should come back from the host tier"
    assert engine.tiers.counters.onboarded > 0
    engine.kv.check_integrity()
    engine.close()


def test_without_tiers_the_same_prompt_is_recomputed(make_engine, long_prompts, cold):
    """The control for the test above: the pool alone cannot keep a's prefix."""
    a, b = long_prompts
    engine = make_engine(kv_cache_memory=POOL)
    run(engine, a)
    run(engine, b)
    out, cached = run(engine, a)
    assert out == cold[0]
    assert cached < (len(a) - 1) // 16 * 16 - 16


def test_disk_tier_onboards_and_survives_a_restart(make_engine, long_prompts, cold, tmp_path):
    a, b = long_prompts
    engine = make_engine(kv_cache_memory=POOL, kv_disk_dir=str(tmp_path), kv_disk_min_uses=1)
    run(engine, a)
    run(engine, b)
    assert engine.tiers.flush()
    assert engine.tiers.counters.offloaded_disk > 0
    out, cached = run(engine, a)
    assert out == cold[0] and cached > 0
    assert engine.tiers.counters.onboarded_disk > 0
    engine.close()  # saves what the pool still holds

    restarted = make_engine(kv_cache_memory=POOL, kv_disk_dir=str(tmp_path), kv_disk_min_uses=1)
    sink = ListSink()
    restarted.add_kv_event_sink(sink)
    announced = {h for e in sink.events if isinstance(e.event, BlockStored) and e.event.tier == "disk"
                 for h in e.event.block_hashes}
    for prompt, expected in zip(long_prompts, cold):
        out, cached = run(restarted, prompt)
        assert out == expected
        assert cached >= (len(prompt) - 1) // 16 * 16 - 16, "the prefix should hit on disk after a restart"
    assert restarted.tiers.counters.onboarded_disk > 0
    assert len(announced) >= restarted.tiers.counters.onboarded_disk
    restarted.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_a_damaged_block_on_disk_is_recomputed(make_engine, long_prompts, cold, tmp_path, damage):
    a, b = long_prompts
    engine = make_engine(kv_cache_memory=POOL, kv_disk_dir=str(tmp_path), kv_disk_min_uses=1)
    run(engine, a)
    engine.close()
    restarted = make_engine(kv_cache_memory=POOL, kv_disk_dir=str(tmp_path), kv_disk_min_uses=1)
    head, second = hash_blocks(a, 16, restarted.kv_namespace)[:2]
    target = restarted.tiers.disk.root / f"{head:016x}.kvb"  # the head of a's chain
    raw = bytearray(target.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0xFF
        target.write_bytes(bytes(raw))
    elif damage == "truncate":
        target.write_bytes(bytes(raw[:-1000]))
    else:  # another block's file under this block's name
        target.write_bytes((restarted.tiers.disk.root / f"{second:016x}.kvb").read_bytes())
    out, cached = run(restarted, a)
    assert out == cold[0]
    assert restarted.tiers.counters.disk_read_failures == 1
    assert restarted.tiers.counters.onboarded_disk == 0 and cached == 0
    assert not target.exists(), "the damaged file is dropped"
    restarted.close()


def test_the_frequency_filter_keeps_one_off_blocks_off_disk(make_engine, long_prompts, tmp_path):
    a, b = long_prompts
    engine = make_engine(kv_cache_memory=POOL, kv_disk_dir=str(tmp_path), kv_disk_min_uses=2)
    run(engine, a)
    run(engine, b)  # evicts a's blocks, each computed once
    assert engine.tiers.flush()
    assert engine.tiers.counters.offloaded_disk == 0
    engine.close()
