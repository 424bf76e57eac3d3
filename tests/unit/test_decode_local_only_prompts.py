"""A decode worker counts the uncached tokens of the prompts it prefills because they are too short
for a remote prefill (or because it has no remote prefill): the autoscaler counts them as decode-side
work, which no prefill worker would take."""

from __future__ import annotations

from services.decode.config import DecodeSettings
from services.decode.service import DecodeWorker
from shared.engine.outputs import EngineOutput
from shared.engine.step_stats import EngineStats
from shared.protocol import GenerateRequest


class OneTokenEngine:
    """Answers every prompt with one token (not finished), ``cached`` of its tokens from the cache."""

    block_size = 16
    num_running = 1

    def __init__(self, cached: int) -> None:
        self.cached = cached

    def stats(self) -> EngineStats:
        return EngineStats(num_running=0, num_waiting=0, num_blocks_total=64, num_blocks_used=0, num_cached_blocks=0,
                           max_num_seqs=8, num_preemptions=0, num_steps=0, num_prompt_tokens=0,
                           num_cached_prompt_tokens=0, num_generated_tokens=0)

    async def generate(self, request_id, prompt_token_ids, params, priority=0, *, deadline=None):
        yield EngineOutput(request_id, [7], None, None, len(prompt_token_ids), self.cached, 1)


class LocalRemote:
    """Remote prefill on, but every prompt ends up prefilled here (no prefill worker took it);
    prompts over ``limit`` tokens may go remote."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def may_go_remote(self, num_prompt_tokens: int) -> bool:
        return num_prompt_tokens > self.limit

    async def start(self, request, params):
        return None


def worker(engine, remote=None) -> DecodeWorker:
    w = DecodeWorker(DecodeSettings(worker_id="d1", model="m"), None, None, engine, remote=remote)
    w.state = "ready"
    return w


async def run(w: DecodeWorker, request_id: str, num_tokens: int) -> None:
    request = GenerateRequest(request_id=request_id, model="m", prompt_token_ids=list(range(1, num_tokens + 1)))
    assert len([chunk async for chunk in w.generate(request)]) == 1


async def test_only_prompts_too_short_for_a_remote_prefill_are_counted_uncached():
    w = worker(OneTokenEngine(cached=16), LocalRemote(limit=512))
    await run(w, "short", 100)
    await run(w, "long", 600)      # prefilled here too, but a prefill worker could have taken it
    assert w.num_local_only_prompt_tokens == 100 - 16


async def test_without_remote_prefill_every_prompt_is_counted():
    w = worker(OneTokenEngine(cached=0))
    await run(w, "a", 100)
    await run(w, "b", 600)
    assert w.load().num_local_only_prompt_tokens_total == 700   # what the autoscaler reads
