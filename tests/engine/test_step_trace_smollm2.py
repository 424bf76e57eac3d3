"""The step trace on the real SmolLM2 with speculation on and two priorities: every step is a line,
every prompt's chunks are in it back to back, and a step that prefills a prompt carries no row of a
lower priority, not even one with a draft ready."""

from __future__ import annotations

from engine_steps import run_to_completion
from loadtest.tools import step_trace
from shared.engine import SamplingParams


def test_the_trace_accounts_for_every_prompt_and_prefill_steps_carry_no_lower_priority_row(
        make_engine, chat_prompts, tmp_path):
    path = tmp_path / "steps.jsonl"
    engine = make_engine(step_trace=str(path), speculative_tokens=4, max_num_batched_tokens=64)
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = {"batch-0": chat_prompts[3], "batch-1": chat_prompts[2]}  # the first repeats itself: drafts
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, greedy, priority=2)
    speculator, batch = engine.scheduler.speculator, engine.scheduler.requests["batch-0"]

    def draft_ready() -> bool:  # what the speculator would propose for the batch request's next step
        return batch.num_tokens - batch.num_computed_tokens == 1 and bool(speculator.proposer.propose(batch, 4))

    steps_run = 0
    while not draft_ready():
        assert steps_run < 40, "the batch request never had a draft ready"
        engine.step()
        steps_run += 1
    drafted_at = steps_run  # the online prompts arrive now: the next step prefills them
    for i, ids in enumerate(chat_prompts[:2]):
        prompts[f"online-{i}"] = ids
        engine.add_request(f"online-{i}", ids, greedy, priority=0)
    steps_run += run_to_completion(engine)
    engine.close()

    steps = step_trace.read(path)
    assert len(steps) == steps_run
    for rid, ids in prompts.items():
        # the prompt's chunks back to back from its first uncached position to its end
        chunks = [(r["start"], r["tokens"]) for s in steps for r in s["rows"] if r["id"] == rid and r["prompt"]]
        assert chunks and all(a + n == b for (a, n), (b, _) in zip(chunks, chunks[1:])), (rid, chunks)
        assert chunks[-1][0] + chunks[-1][1] == len(ids), (rid, chunks)
    assert any(r["prompt"] and r["priority"] == 0 for r in steps[drafted_at]["rows"])
    online_prefills = [s for s in steps if any(r["prompt"] and r["priority"] == 0 for r in s["rows"])]
    for s in online_prefills:
        assert all(r["priority"] == 0 for r in s["rows"]), s
    assert any(r["draft"] for s in steps for r in s["rows"] if r["id"] == "batch-0")  # drafts came, later
    assert step_trace.summarize(steps)["kinds"].keys() >= {"prefill p0", "prefill p2", "decode"}
