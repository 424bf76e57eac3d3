"""The engine's step trace (``shared/engine/step_trace.py``) and its summary
(``loadtest/tools/step_trace.py``): every step a line, with the rows it carried."""

from engine_steps import run_to_completion
from shared.engine import EngineConfig, LLMEngine, SamplingParams
from loadtest.tools import step_trace


def test_each_step_is_a_line_with_its_prompt_chunks_and_decode_rows(tiny_engine_model, tmp_path):
    path = tmp_path / "trace" / "steps.jsonl"
    engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=4,
                                                       max_num_batched_tokens=16, step_trace=str(path)))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("urgent", [5 + j for j in range(10)], params, priority=0)
    engine.add_request("later", [7 + j for j in range(20)], params, priority=2)
    steps_run = run_to_completion(engine)
    engine.close()

    steps = step_trace.read(path)
    assert len(steps) == steps_run
    assert all(s["s"] > 0 for s in steps) and [s["t"] for s in steps] == sorted(s["t"] for s in steps)
    rows = {(r["id"], r["start"]): r for s in steps for r in s["rows"]}
    # the budget of 16 tokens: the urgent prompt whole, the later one in chunks after it
    assert rows[("urgent", 0)] == {"id": "urgent", "priority": 0, "start": 0, "tokens": 10, "prompt": True, "draft": 0}
    later_chunks = [r["tokens"] for (rid, _), r in sorted(rows.items()) if rid == "later" and r["prompt"]]
    assert sum(later_chunks) == 20 and len(later_chunks) >= 2
    urgent_decodes = [r for (rid, _), r in rows.items() if rid == "urgent" and not r["prompt"]]
    assert [r["tokens"] for r in urgent_decodes] == [1, 1]  # 3 tokens: the prompt's step samples the first

    summary = step_trace.summarize(steps)
    assert summary["steps"] == steps_run
    assert set(summary["kinds"]) == {"prefill p0", "prefill p2", "decode"}
    assert sum(k["steps"] for k in summary["kinds"].values()) == steps_run
    assert 0 < summary["busy"] <= 1.0 + 1e-6


def test_the_summary_counts_only_the_steps_in_its_windows_and_shares_their_time():
    def step(t, s, *rows):
        return {"t": t, "s": s, "rows": [{"id": i, "priority": p, "start": 0, "tokens": n, "prompt": pr, "draft": 0}
                                         for i, p, n, pr in rows]}

    steps = [step(0.0, 0.2, ("a", 0, 70, True)),
             step(0.5, 0.1, ("a", 0, 1, False), ("b", 1, 1, False)),
             step(1.0, 0.3, ("a", 0, 1, False), ("c", 1, 60, True)),   # a batch prompt, an online row riding along
             step(5.0, 0.1, ("a", 0, 1, False))]
    summary = step_trace.summarize(steps, [(0.0, 1.0), (1.0, 2.0)])
    assert summary["steps"] == 3 and summary["window_s"] == 2.0
    assert summary["busy"] == (0.2 + 0.1 + 0.3) / 2.0
    assert summary["kinds"]["prefill p1"]["time_share"] == 0.3 / 2.0
    assert summary["kinds"]["prefill p0"]["steps"] == 1 and summary["kinds"]["decode"]["steps"] == 1
    assert summary["decode_rows_per_decode_step"] == 2
    assert step_trace.summarize(steps, [(9.0, 10.0)]) == {"steps": 0}
    assert "engine busy 30%" in step_trace.format_summary(summary)


def test_the_summary_says_what_each_prefill_step_came_right_after_and_counts_stopped_steps_apart():
    def step(t, *rows, paused=None):
        entry = {"t": t, "s": 0.1, "rows": [{"id": i, "priority": p, "start": 0, "tokens": n, "prompt": n > 1,
                                             "draft": 0} for i, p, n in rows]}
        return entry | ({"paused": paused} if paused else {})

    steps = [step(0.0, ("b1", 1, 60)),                              # a batch prompt ran to its end
             step(1.0, ("o1", 0, 50)),                              # an online prompt waited for it
             step(2.0, ("o1", 0, 1), paused=["b2"]),                # the next batch prompt stopped ...
             step(3.0, ("o2", 0, 40)),                              # ... for this one
             step(4.0, ("b2", 1, 70)),                              # and went on
             step(5.0, ("o1", 0, 1), ("o2", 0, 1))]
    kinds = step_trace.summarize(steps)["kinds"]
    assert kinds["stopped"]["steps"] == 1 and kinds["decode"]["steps"] == 1
    assert kinds["prefill p0"]["after"] == {"prefill p1": 1, "stopped": 1}
    assert kinds["prefill p1"]["after"] == {"prefill p0": 1}
    assert "after" not in kinds["decode"] and "after" not in kinds["stopped"]
    assert "right after: prefill p1 1, stopped 1" in step_trace.format_summary(step_trace.summarize(steps))
