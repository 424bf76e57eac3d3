"""On the real SmolLM2 through the AsyncEngine: a premium request posted while a step computes a batch
prompt stops that step between two layers; the premium prompt is computed next and its first token
comes before the batch request's, and both get the greedy tokens they get alone."""

from __future__ import annotations

import asyncio
import threading

from loadtest.tools import step_trace
from shared.engine import SamplingParams
from shared.engine.async_engine import AsyncEngine, _Add

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
HOOKED_LAYER = 5


async def test_a_premium_request_posted_mid_step_gets_its_first_token_before_the_batch_prompt_ends(
        make_engine, chat_prompts, tmp_path):
    batch_prompt, premium_prompt = chat_prompts[3], chat_prompts[0]  # ~250 tokens, one step; a short one
    alone = make_engine().generate([batch_prompt, premium_prompt], GREEDY)
    trace = tmp_path / "steps.jsonl"
    engine = make_engine(max_num_batched_tokens=512, step_trace=str(trace))
    aengine = AsyncEngine(engine)
    in_batch_step, posted = threading.Event(), threading.Event()
    post = aengine._post

    def post_and_tell(item):
        post(item)
        if isinstance(item, _Add) and item.priority == 0:
            posted.set()

    layer = engine.model.layers[HOOKED_LAYER]
    forward = layer.forward

    def forward_and_wait(views, hidden, *args):
        # the batch prompt's step is in this layer: the premium request arrives now (the engine thread
        # waits here until it is posted, so the arrival falls inside the step on any machine)
        if hidden.shape[0] >= len(batch_prompt) and not in_batch_step.is_set():
            in_batch_step.set()
            assert posted.wait(60), "the premium request was never posted"
        return forward(views, hidden, *args)

    aengine._post = post_and_tell
    layer.forward = forward_and_wait
    first_token_order: list[str] = []

    async def collect(rid: str, prompt: list[int], priority: int) -> list[int]:
        tokens = []
        async for out in aengine.generate(rid, prompt, GREEDY, priority):
            if not tokens:
                first_token_order.append(rid)
            tokens.extend(out.new_token_ids)
        return tokens

    try:
        batch = asyncio.create_task(collect("batch", batch_prompt, 2))
        assert await asyncio.get_running_loop().run_in_executor(None, in_batch_step.wait, 60)
        premium = await collect("premium", premium_prompt, 0)
        assert [await batch, premium] == alone
    finally:
        del layer.forward  # the model is the session's: back to the class's method
        aengine.shutdown()
    assert first_token_order == ["premium", "batch"]

    steps = step_trace.read(trace)
    stopped = [s for s in steps if s.get("paused")]
    assert [s["paused"] for s in stopped] == [["batch"]]
    after = steps[steps.index(stopped[0]) + 1:]
    # the next step computed the premium prompt alone; the batch prompt's rows are listed once, by the
    # step that ended its stopped part, after it
    assert [(r["id"], r["prompt"]) for r in after[0]["rows"]] == [("premium", True)]
    batch_prompt_rows = [(s, r) for s in steps for r in s["rows"] if r["id"] == "batch" and r["prompt"]]
    assert len(batch_prompt_rows) == 1 and batch_prompt_rows[0][0] in after[1:]
    assert batch_prompt_rows[0][1]["tokens"] == len(batch_prompt)
