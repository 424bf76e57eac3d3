"""bench.compile's timed steps during a compile: every one at a context within the prompt plus
``--cycle-tokens``, however many are taken, so steps taken minutes apart are comparable."""

from __future__ import annotations

from loadtest.bench.compile import recycled_step
from shared.engine import EngineConfig, LLMEngine, SamplingParams


def test_requests_restart_so_every_timed_step_decodes_within_the_cycle(tiny_engine_model):
    engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=4))
    prompt = [5 + (7 * j) % 50 for j in range(12)]
    for i in range(2):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
    cycle, ids = 5, set()
    for _ in range(4 * cycle):
        assert recycled_step(engine, cycle) >= 0
        running = engine.scheduler.running
        assert len(running) == 2
        for r in running:
            # decoding, past the prompt, and never more than the cycle's tokens into its output
            assert r.num_computed_tokens >= len(prompt) and 1 <= len(r.output_token_ids) <= cycle
            assert list(r.prompt_token_ids) == prompt
            ids.add(r.request_id)
    assert len(ids) > 2  # the requests were restarted under fresh ids
