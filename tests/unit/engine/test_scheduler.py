"""The scheduler alone: no model, tokens are appended by hand."""

from shared.engine.request import Request, RequestStatus, SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig
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
    sampled = {x.request.request_id: token for x in out.scheduled if x.samples}
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


def test_abort_frees_everything():
    s = make()
    s.add_request(req("a", 10))
    step(s)
    assert s.kv.num_free_blocks < 16
    aborted = s.abort("a")
    assert aborted.status is RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished
    assert s.abort("a") is None
