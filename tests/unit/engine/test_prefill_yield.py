"""A step's prefill of a lower priority stops between two layers when a more urgent request is on its
way (``LLMEngine.announce_request``), the urgent prompt runs next, and the stopped part goes on where it
stopped: the same tokens as a run that never stopped, and nothing lost when one of its requests is
aborted or preempted meanwhile. On a tiny random-weight Llama of 4 layers, in float32 and eager (so
every row of a step is in its eager part)."""

from __future__ import annotations

import itertools

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from tiny_hf_models import save_tiny

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BATCH = [3 + (7 * j) % 200 for j in range(40)]
BATCH_2 = [11 + (5 * j) % 180 for j in range(24)]
URGENT = [9 + j for j in range(12)]


def make(model, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 4 << 20)
    kw.setdefault("block_size", 4)
    return LLMEngine(model, EngineConfig(**kw))


@pytest.fixture(scope="module")
def tiny_engine_model(tmp_path_factory):
    from shared.model.loader import load_model

    path = tmp_path_factory.mktemp("tiny4")
    save_tiny("llama", path, num_hidden_layers=4)
    return load_model(path, "hf", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def alone(tiny_engine_model) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, run alone with nothing stopping."""
    engine = make(tiny_engine_model, prefill_yield=False)
    tokens = {name: engine.generate([ids], GREEDY)[0]
              for name, ids in (("batch", BATCH), ("batch-2", BATCH_2), ("urgent", URGENT))}
    tokens["urgent-12"] = engine.generate([URGENT], SamplingParams(max_tokens=12, temperature=0.0,
                                                                   ignore_eos=True))[0]
    return tokens


def run_to_end(engine: LLMEngine, tokens: dict[str, list[int]], order: list[str]) -> None:
    for _ in range(200):
        if not engine.has_unfinished_requests():
            return
        for out in engine.step():
            if not tokens.setdefault(out.request_id, []):
                order.append(out.request_id)
            tokens[out.request_id].extend(out.new_token_ids)
    raise AssertionError("the engine did not finish")


def assert_all_blocks_free(engine: LLMEngine) -> None:
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    engine.kv.check_integrity()


def test_a_lower_priority_prefill_stops_for_an_urgent_request_and_goes_on_with_the_same_tokens(
        tiny_engine_model, alone):
    engine = make(tiny_engine_model)
    layers = len(engine.model.layers)
    assert layers == 4
    engine.add_request("batch", BATCH, GREEDY, priority=2)
    engine.announce_request(0)  # a priority-0 request is on its way in
    assert engine.step() == []
    part = engine.runner.suspended
    assert part is not None and part.state.next_layer == 1 < layers
    batch = engine.scheduler.requests["batch"]
    assert batch.suspended and batch.num_computed_tokens == 0

    engine.clear_announced()  # it is added: the next step computes its prompt, not the stopped part
    engine.add_request("urgent", URGENT, GREEDY, priority=0)
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["urgent"]
    assert engine.runner.suspended is part and part.state.next_layer == 1

    engine.announce_request(0)  # another one: the part goes on one layer at a time while it is announced
    assert engine.step() == [] and engine.runner.suspended is part and part.state.next_layer == 2
    engine.clear_announced()
    tokens, order = {"urgent": outputs[0].new_token_ids}, ["urgent"]
    run_to_end(engine, tokens, order)
    assert tokens == {"urgent": alone["urgent"], "batch": alone["batch"]}
    assert order == ["urgent", "batch"]
    assert engine.runner.suspended is None and not batch.suspended
    assert_all_blocks_free(engine)


def test_a_stopped_part_goes_on_when_nothing_more_urgent_is_left(tiny_engine_model, alone):
    engine = make(tiny_engine_model)
    engine.add_request("batch", BATCH, GREEDY, priority=2)
    engine.announce_request(0)
    engine.step()
    engine.clear_announced()  # the urgent request never came (its client left): the part ends now
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["batch"] and engine.runner.suspended is None
    tokens: dict[str, list[int]] = {"batch": outputs[0].new_token_ids}
    run_to_end(engine, tokens, [])
    assert tokens["batch"] == alone["batch"]


def test_no_stop_for_a_request_of_the_same_priority_or_with_prefill_yield_off(tiny_engine_model):
    for priority, config in ((2, {}), (0, {"prefill_yield": False})):
        engine = make(tiny_engine_model, **config)
        engine.add_request("batch", BATCH, GREEDY, priority=2)
        engine.announce_request(priority)
        assert [o.request_id for o in engine.step()] == ["batch"]
        assert engine.runner.suspended is None


def test_an_aborted_request_drops_the_stopped_part_and_its_step_mate_computes_again(tiny_engine_model, alone):
    engine = make(tiny_engine_model)
    engine.add_request("batch", BATCH, GREEDY, priority=2)
    engine.add_request("batch-2", BATCH_2, GREEDY, priority=2)
    engine.announce_request(0)
    assert engine.step() == []
    assert {s.request.request_id for s in engine.runner.suspended.entries} == {"batch", "batch-2"}
    engine.clear_announced()
    assert engine.abort_request("batch") is not None
    tokens: dict[str, list[int]] = {}
    run_to_end(engine, tokens, [])
    assert tokens == {"batch-2": alone["batch-2"]}
    assert engine.runner.suspended is None
    assert_all_blocks_free(engine)


def test_a_preempted_request_drops_the_stopped_part_and_computes_again(tiny_engine_model, alone):
    """One sequence slot: the urgent request takes the stopped one's slot (a preemption frees its
    blocks, which the urgent prompt may then use), so the stopped part cannot go on."""
    engine = make(tiny_engine_model, max_num_seqs=1)
    engine.add_request("batch", BATCH, GREEDY, priority=2)
    engine.announce_request(0)
    engine.step()
    batch = engine.scheduler.requests["batch"]
    engine.clear_announced()
    engine.add_request("urgent", URGENT, GREEDY, priority=0)
    tokens: dict[str, list[int]] = {}
    order: list[str] = []
    run_to_end(engine, tokens, order)
    assert batch.num_preemptions == 1
    assert tokens == {"urgent": alone["urgent"], "batch": alone["batch"]} and order == ["urgent", "batch"]
    assert_all_blocks_free(engine)


class EagerStandIn:
    """Takes the compiled step's place (``ModelRunner.compiled``): the model's own forward, so a
    step's decode rows run as a forward of their own before its eager part, as with the compiled step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.model, self.backend = engine.model, engine.backend

    def forward(self, ids, pos, kv_cache, meta):
        return self.model.forward(ids, pos, kv_cache, meta, self.backend)


def test_the_decode_rows_before_the_eager_part_get_their_tokens_in_the_step_that_stopped(tiny_engine_model):
    def run(stop: bool) -> tuple[dict[str, list[int]], list[list[str]]]:
        engine = make(tiny_engine_model, prefill_slice_ms=0)  # no stop for the urgent decode rows
        engine.runner.use_compiled(EagerStandIn(engine))
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        engine.add_request("urgent", URGENT, params, priority=0)
        tokens: dict[str, list[int]] = {}
        for out in engine.step() + engine.step():  # its prompt, then a decode row (the stand-in's)
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.add_request("batch", BATCH, GREEDY, priority=2)
        if stop:
            engine.announce_request(0)
        step = engine.step()  # the urgent decode row first, then the batch prompt (stopped, or not)
        per_step = [[o.request_id for o in step]]
        for out in step:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert (engine.runner.suspended is not None) == stop
        engine.clear_announced()
        run_to_end(engine, tokens, [])
        assert_all_blocks_free(engine)
        return tokens, per_step

    stopped, stopped_steps = run(stop=True)
    straight, straight_steps = run(stop=False)
    assert stopped_steps == [["urgent"]] and straight_steps == [["urgent", "batch"]]
    assert stopped == straight and len(stopped["urgent"]) == 12 and len(stopped["batch"]) == 6


@pytest.mark.parametrize("urgent_priority, config, sliced", [
    (0, {}, True),
    (2, {}, False),  # decode rows of the prompt's own priority: no slices
    (0, {"prefill_slice_ms": 0}, False),
    (0, {"prefill_yield": False}, False),
])
def test_a_lower_priority_prompt_goes_in_slices_while_a_more_urgent_request_decodes(
        tiny_engine_model, alone, urgent_priority, config, sliced):
    """Each look at the engine's clock is 10 ms later, and a slice is 15 ms: the batch prompt's step
    stops after its second layer (the urgent decode row ran before it, compiled), a step of the urgent
    decode row alone follows, then the prompt's last two layers. Same tokens as without slices."""
    engine = make(tiny_engine_model, **{"prefill_slice_ms": 15.0, **config})
    engine.runner.use_compiled(EagerStandIn(engine))
    ticks = itertools.count()
    engine.slicer.clock = lambda: next(ticks) * 0.010
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("urgent", URGENT, params, priority=urgent_priority)
    tokens: dict[str, list[int]] = {}
    for out in engine.step() + engine.step():  # its prompt, then a decode row (the stand-in's)
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.add_request("batch", BATCH, GREEDY, priority=2)
    per_step = []
    for _ in range(3):
        outputs = engine.step()
        per_step.append(([o.request_id for o in outputs], None if engine.runner.suspended is None
                         else engine.runner.suspended.state.next_layer))
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    if sliced:
        assert per_step == [(["urgent"], 2), (["urgent"], 2), (["batch"], None)]
    else:
        assert per_step[0] == (["urgent", "batch"], None)
    run_to_end(engine, tokens, [])
    assert tokens == {"urgent": alone["urgent-12"], "batch": alone["batch"]}
    assert_all_blocks_free(engine)
