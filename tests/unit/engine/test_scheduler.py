"""The scheduler alone: no model, tokens are appended by hand."""

import pytest

from shared.engine.request import Request, RequestStatus, SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig
from shared.engine.speculative import SpeculativeConfig, Speculator
from shared.kvcache.hashing import make_namespace
from shared.kvcache.manager import KVCacheManager

BS = 4


def make(num_blocks=16, budget=64, max_seqs=8):
    kv = KVCacheManager(num_blocks, BS)
    return Scheduler(SchedulerConfig(max_seqs, budget, 1024), kv, make_namespace("m"))


def req(rid, n, max_tokens=4, priority=0):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   priority=priority)


def step(s, token=7):
    out = s.schedule()
    sampled = {x.request.request_id: [token] for x in out.scheduled if x.samples}
    s.update_from_output(out, sampled)
    return out


def test_chunked_prefill_respects_the_budget_and_mixes_decodes():
    s = make(budget=8)
    s.add_request(req("a", 3))
    out = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 3)]
    s.add_request(req("b", 20))
    out = step(s)
    # decode of a first, then a 7-token chunk of b
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 7)]
    assert out.num_tokens == 8 and not out.scheduled[1].samples
    out = step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [1, 7]
    out = step(s)  # a finishes at 4 tokens; b gets its last 6 and samples
    assert s.requests.get("a") is None
    assert out.scheduled[-1].request.request_id == "b" and out.scheduled[-1].samples


def test_preemption_frees_blocks_and_recomputes():
    s = make(num_blocks=4, budget=64)
    a, b = req("a", 7, max_tokens=8), req("b", 7, max_tokens=8)  # 2 blocks each, growing to 4
    s.add_request(a)
    s.add_request(b)
    step(s)
    assert len(s.running) == 2
    preempted = []
    for _ in range(10):
        out = step(s)
        preempted += out.preempted
        s.kv.check_integrity()
    assert preempted and set(preempted) == {"b"}  # only the later arrival yields
    while s.has_unfinished:
        step(s)
    assert a.num_preemptions == 0 and b.num_preemptions == len(preempted)
    assert len(a.output_token_ids) == len(b.output_token_ids) == 8
    assert s.kv.num_free_blocks == 4
    s.kv.check_integrity()


def test_priority_orders_admission():
    s = make(max_seqs=1)
    s.add_request(req("low", 3, priority=5))
    s.add_request(req("high", 3, priority=0))
    out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["high"]


def test_a_higher_priority_request_takes_the_slot_of_the_lowest_priority_runner():
    s = make(max_seqs=2)
    s.add_request(req("batch-old", 3, max_tokens=8, priority=2))
    s.add_request(req("batch-new", 3, max_tokens=8, priority=2))
    step(s)
    s.add_request(req("premium", 3, priority=0))
    s.add_request(req("also-batch", 3, priority=2))   # same priority as the runners: waits
    out = step(s)
    assert out.preempted == ["batch-new"]            # the latest arrival of the lowest priority
    # premium's prefill step leaves batch-old's decode row out (it decodes again the step after)
    assert [x.request.request_id for x in out.scheduled] == ["premium"]
    assert [r.request_id for r in s.waiting] == ["batch-new", "also-batch"]
    backlog = s.backlog()  # what admission's slot-wait prediction reads, by priority
    assert (backlog.num_running, backlog.num_waiting) == ({2: 1, 0: 1}, {2: 2})
    s.kv.check_integrity()
    run_to_end(s)
    assert not s.requests and s.kv.pool.num_used_blocks == 0


def test_a_runner_that_has_its_first_token_yields_its_slot_before_one_that_has_not():
    s = make(max_seqs=2, budget=4)
    s.add_request(req("batch-old", 3, max_tokens=8, priority=2))
    step(s)                                            # batch-old has its first token
    s.add_request(req("batch-new", 12, max_tokens=8, priority=2))
    out = step(s)                                      # batch-new's first chunk: no token yet
    assert not s.requests["batch-new"].output_token_ids
    s.add_request(req("premium", 3, priority=0))
    out = step(s)
    # the latest arrival would lose its slot before its first token (and again at every premium
    # arrival); batch-old only pays a recompute of its cached prefix
    assert out.preempted == ["batch-old"]
    s.kv.check_integrity()
    run_to_end(s)
    assert not s.requests and s.kv.pool.num_used_blocks == 0


def test_a_step_prefilling_a_higher_priority_prompt_leaves_lower_priority_rows_out():
    s = make(num_blocks=64, max_seqs=8)
    for rid, priority in (("premium-old", 0), ("batch-a", 2), ("batch-b", 2)):
        s.add_request(req(rid, 3, max_tokens=8, priority=priority))
    # the batch prompts' prefills wait for the step after the premium prompt's
    assert {x.request.request_id for x in step(s).scheduled} == {"premium-old"}
    assert {x.request.request_id for x in step(s).scheduled} == {"premium-old", "batch-a", "batch-b"}
    s.add_request(req("standard", 5, priority=1))
    out = step(s)
    # the premium row decodes with the prompt; the batch rows wait this one step, then decode again
    assert sorted((x.request.request_id, x.num_new_tokens) for x in out.scheduled) == [
        ("premium-old", 1), ("standard", 5)]
    assert s.requests["batch-a"].num_computed_tokens == 3 and len(s.requests["batch-a"].output_token_ids) == 1
    assert {x.request.request_id for x in step(s).scheduled} == {"premium-old", "batch-a", "batch-b", "standard"}
    # a prompt of the lowest priority leaves nobody out
    s.add_request(req("batch-late", 4, priority=2))
    assert len(step(s).scheduled) == 5
    run_to_end(s)
    s.kv.check_integrity()
    assert not s.requests


def test_abort_frees_everything():
    s = make()
    s.add_request(req("a", 10))
    step(s)
    assert s.kv.num_free_blocks < 16
    aborted = s.abort("a")
    assert aborted.status is RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished
    assert s.abort("a") is None


# -- the decode side of remote prefill: reserved blocks, written by another worker ----------------------

def run_to_end(s):
    while s.has_unfinished:
        step(s)


def test_reserve_remote_takes_blocks_for_the_whole_prompt_and_waits():
    s = make()
    a = req("a", 10)  # 3 blocks of 4
    table, num_cached = s.reserve_remote(a)
    assert num_cached == 0 and len(table) == 3 and s.kv.num_free_blocks == 13
    assert a.status is RequestStatus.WAITING_FOR_REMOTE_KV and s.remote == {"a": a}
    # nothing to step while the KV is awaited
    assert not s.has_unfinished and s.schedule().scheduled == []


def test_written_kv_counts_as_computed_and_only_the_tail_is_prefilled():
    s = make()
    s.reserve_remote(req("a", 10))
    assert s.finish_remote("a", kv_written=True).status is RequestStatus.RUNNING
    out = step(s)
    # 8 tokens (2 full blocks) were written: only the partial block's 2 tokens run here, and sample
    assert [(x.request.request_id, x.start, x.num_new_tokens, x.samples) for x in out.scheduled] == [("a", 8, 2, True)]
    run_to_end(s)
    assert s.kv.num_free_blocks == 16 and not s.remote
    s.kv.check_integrity()


def test_a_block_multiple_prompt_recomputes_its_last_token_for_the_logits():
    s = make()
    s.reserve_remote(req("a", 8))
    s.finish_remote("a", kv_written=True)
    assert [(x.start, x.num_new_tokens) for x in step(s).scheduled] == [(7, 1)]


def test_no_kv_written_prefills_locally_from_the_cached_prefix():
    s = make()
    s.add_request(req("warm", 10, max_tokens=1))
    run_to_end(s)  # leaves 2 full blocks of the same prompt in the prefix cache
    table, num_cached = s.reserve_remote(req("a", 10))
    assert num_cached == 8
    s.finish_remote("a", kv_written=False)
    assert [(x.start, x.num_new_tokens) for x in step(s).scheduled] == [(8, 2)]
    run_to_end(s)
    assert s.kv.num_free_blocks == 16


def test_decide_sees_the_cached_prefix_and_no_changes_nothing():
    s = make()
    s.add_request(req("warm", 10, max_tokens=1))
    run_to_end(s)
    seen = []
    assert s.reserve_remote(req("a", 10), decide=lambda n: seen.append(n) or False) is None
    assert seen == [8] and not s.remote and "a" not in s.requests and s.kv.num_free_blocks == 16
    assert s.reserve_remote(req("a", 10), decide=lambda n: True)[1] == 8  # the id is still free


def test_a_reservation_the_pool_cannot_hold_now_changes_nothing():
    s = make(num_blocks=4)
    assert s.reserve_remote(req("a", 12)) is not None  # 3 of 4 blocks
    assert s.reserve_remote(req("b", 8)) is None  # needs 2
    assert set(s.remote) == {"a"} and "b" not in s.requests and s.kv.num_free_blocks == 1


def test_an_aborted_reservation_keeps_its_blocks_until_the_transfer_ends():
    s = make()
    s.reserve_remote(req("a", 10))
    assert s.abort("a").status is RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks == 13  # a write may still land in them
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(req("a", 3))
    assert s.finish_remote("a", kv_written=True).status is RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks == 16 and not s.remote and not s.has_unfinished
    assert s.finish_remote("a", kv_written=True) is None  # a late or repeated notification


# -- keep_kv: a finished request's blocks are held until released ----------------------------------------

def held_req(rid, n, max_tokens=2):
    r = req(rid, n, max_tokens)
    r.keep_kv = True
    return r


def test_a_finished_keep_kv_request_holds_its_blocks_until_released():
    s = make()
    s.add_request(held_req("p", 10, max_tokens=1))
    run_to_end(s)
    assert set(s.held) == {"p"} and "p" not in s.requests
    assert s.kv.num_free_blocks == 13 and len(s.kv.block_ids("p")) == 3
    assert s.release("p") and not s.held and s.kv.num_free_blocks == 16
    assert not s.release("p")
    s.kv.check_integrity()


@pytest.mark.parametrize("kv_written", [True, False], ids=["written", "fell-back"])
def test_a_remote_keep_kv_request_is_held_after_it_finishes(kv_written):
    s = make()
    s.reserve_remote(held_req("d", 10, max_tokens=3))
    s.finish_remote("d", kv_written=kv_written)
    run_to_end(s)
    assert set(s.held) == {"d"} and not s.remote
    assert s.kv.num_free_blocks == 13  # 10 prompt + 2 appended tokens: 3 blocks
    with pytest.raises(ValueError, match="duplicate"):
        s.reserve_remote(req("d", 3))
    assert s.release("d") and s.kv.num_free_blocks == 16 and not s.held
    s.kv.check_integrity()


def test_an_aborted_keep_kv_reservation_is_held_after_the_transfer_ends():
    s = make()
    s.reserve_remote(held_req("d", 10))
    s.abort("d")
    s.finish_remote("d", kv_written=False)
    assert set(s.held) == {"d"} and s.kv.num_free_blocks == 13
    assert s.release("d") and s.kv.num_free_blocks == 16


def own(rid, n, priority):
    """A request whose prompt shares no prefix with another's."""
    start = 1000 * (1 + sum(map(ord, rid)))
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=4, temperature=0.0),
                   priority=priority)


def test_a_low_priority_prompt_mid_prefill_yields_its_chunks_to_a_higher_priority_arrival():
    s = make(num_blocks=64, budget=8)
    s.add_request(own("bulk", 40, priority=2))
    assert [(x.request.request_id, x.num_new_tokens) for x in step(s).scheduled] == [("bulk", 8)]
    s.add_request(own("later-bulk", 6, priority=2))  # same priority: waits for bulk's prompt
    s.add_request(own("premium", 6, priority=0))
    s.add_request(own("middle", 4, priority=1))
    out = step(s)
    # premium's whole prompt, alone: the lower priorities' prefills would lengthen its step
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("premium", 6)]
    out = step(s)  # premium decodes; middle's prompt; bulk still waits (middle outranks it)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("premium", 1), ("middle", 4)]
    out = step(s)  # no prompt above bulk's: it resumes where it stopped, with the budget left
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [
        ("premium", 1), ("middle", 1), ("bulk", 6)]
    assert s.requests["bulk"].num_computed_tokens == 14
    while s.has_unfinished:
        step(s)
        s.kv.check_integrity()


def test_a_lower_prioritys_speculative_row_is_left_out_of_a_higher_prioritys_prefill_step_too():
    kv = KVCacheManager(64, BS)
    s = Scheduler(SchedulerConfig(8, 64, 1024), kv, make_namespace("m"),
                  speculator=Speculator(SpeculativeConfig(num_tokens=3)))
    s.add_request(Request("bulk", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=20, temperature=0.0),
                          priority=2))
    step(s, token=3)                           # its prompt; then "... 1, 2, 3" is followed by 4 earlier
    out = step(s, token=4)
    assert [(x.request.request_id, x.draft) for x in out.scheduled] == [("bulk", [4, 1, 2])]
    s.add_request(own("premium", 6, priority=0))
    out = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("premium", 6)]
    out = step(s)                              # premium decodes; bulk's draft is proposed again beside it
    assert {x.request.request_id: bool(x.draft) for x in out.scheduled} == {"premium": False, "bulk": True}
    while s.has_unfinished:
        step(s)
        kv.check_integrity()


def test_with_one_priority_running_prompts_keep_their_chunks_before_new_arrivals():
    s = make(num_blocks=64, budget=8)
    s.add_request(req("a", 20))
    step(s)
    s.add_request(req("b", 4))
    assert [(x.request.request_id, x.num_new_tokens) for x in step(s).scheduled] == [("a", 8)]
    assert [(x.request.request_id, x.num_new_tokens) for x in step(s).scheduled] == [("a", 4), ("b", 4)]


def test_within_a_priority_the_earliest_deadline_is_admitted_first():
    s = make(num_blocks=64, budget=64, max_seqs=1)
    s.add_request(own("running", 4, priority=1))
    step(s)
    late, none, early, urgent = (own("late", 4, 1), own("none", 4, 1), own("early", 4, 1), own("urgent", 4, 0))
    late.deadline, early.deadline, urgent.deadline = 200.0, 100.0, 500.0
    for r in (none, late, early, urgent):
        s.add_request(r)
    # priority first (urgent's later deadline does not matter), then deadlines, no deadline last
    assert [r.request_id for r in s.waiting] == ["urgent", "early", "late", "none"]
    order = []
    while s.has_unfinished:
        for x in step(s).scheduled:
            if x.request.request_id not in order:
                order.append(x.request.request_id)
    # urgent took running's slot; running, preempted, arrived before "none" and goes before it
    assert order == ["urgent", "early", "late", "running", "none"]
