"""On the real SmolLM2 through the AsyncEngine: a premium request posted while a step computes a batch
prompt stops that step between two layers; the premium prompt is computed next and its first token
comes before the batch request's, and both get the greedy tokens they get alone. While the premium
request decodes, the batch prompt's step goes in slices with premium decode steps between them."""

from __future__ import annotations

import asyncio
import itertools
import threading
import types

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
    # no slices for the premium decode rows here (the test below): one stop, for the arrival
    engine = make_engine(max_num_batched_tokens=512, step_trace=str(trace), prefill_slice_ms=0)
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


def test_a_batch_prompt_goes_in_slices_between_the_steps_of_a_decoding_premium_request(make_engine, chat_prompts,
                                                                                       tmp_path):
    """Each look at the engine's clock is 10 ms later and a slice is 25 ms, so the batch prompt's
    step stops after every third layer for a step of the premium decode row alone: the premium stream gets a
    token between every two slices instead of waiting for the whole prompt, and both requests get the
    greedy tokens they get alone."""
    batch_prompt, premium_prompt = chat_prompts[3], chat_prompts[0]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = make_engine().generate([batch_prompt, premium_prompt], [GREEDY, params])
    trace = tmp_path / "steps.jsonl"
    engine = make_engine(max_num_batched_tokens=512, step_trace=str(trace), prefill_slice_ms=25.0)
    # decode rows go through the compiled step, not in the prompt's forward (eagerly they share it, and
    # that step is the premium request's too): the model's own forward stands in for the compiled graph
    engine.runner.use_compiled(types.SimpleNamespace(
        forward=lambda ids, pos, kv_cache, meta: engine.model.forward(ids, pos, kv_cache, meta, engine.backend)))
    ticks = itertools.count()
    engine.slicer.clock = lambda: next(ticks) * 0.010
    engine.add_request("premium", premium_prompt, params, priority=0)
    tokens: dict[str, list[int]] = {}
    for out in engine.step():  # its prompt: it decodes from now on
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.add_request("batch", batch_prompt, GREEDY, priority=2)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [tokens["batch"], tokens["premium"]] == alone

    steps = step_trace.read(trace)
    first = next(i for i, s in enumerate(steps) if "batch" in s.get("paused", []))
    layers = len(engine.model.layers)
    slices = -(-layers // 3)  # a stop every third layer, and the last slice ends the prompt
    window = steps[first:first + 2 * slices - 1]
    # slices stop (naming the batch rows they left) and premium decode steps alternate
    assert [s.get("paused", []) for s in window[0:-1:2]] == [["batch"]] * (slices - 1)
    assert all([r["id"] for r in s["rows"]] == ["premium"] for s in window[1::2])
    assert [(r["id"], r["prompt"]) for r in window[-1]["rows"]] == [("batch", True)]
