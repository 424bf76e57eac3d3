"""Routing cost, queue-limit admission and the cluster view's optimistic load accounting."""

from shared.cluster.view import ClusterView
from shared.policy.kv_routing import RoutingWeights, WorkerLoadView, choose_worker
from shared.protocol import WorkerInfo, WorkerLoad


def view(worker_id, active=0, waiting=0, unreported=0):
    return WorkerLoadView(worker_id, num_active_blocks=active, num_waiting=waiting,
                          num_admitted_unreported=unreported)


def test_overlap_beats_equal_load_and_load_beats_small_overlap():
    workers = [view("a", active=10), view("b", active=10)]
    assert choose_worker(workers, {"b": 6}, num_request_blocks=8).worker_id == "b"
    busy = [view("a", active=0), view("b", active=100)]
    assert choose_worker(busy, {"b": 2}, num_request_blocks=8).worker_id == "a"


def test_least_loaded_fallback_and_deterministic_ties():
    workers = [view("b", active=3), view("a", active=3), view("c", active=1)]
    assert choose_worker(workers, {}, 4).worker_id == "c"
    assert choose_worker(workers[:2], {}, 4).worker_id == "a"


def test_ties_go_in_turn_after_the_worker_chosen_last():
    """Quiet workers that hold the same prefix tie: new conversations take them in turn instead of
    piling onto the lowest id; a worker with fewer active blocks still wins a cost tie first."""
    idle = [view("c"), view("a"), view("b")]
    order, last = [], ""
    for _ in range(4):
        last = choose_worker(idle, {"a": 1, "b": 1, "c": 1}, 4, chosen_last=last).worker_id
        order.append(last)
    assert order == ["a", "b", "c", "a"]
    assert choose_worker(idle, {}, 4, chosen_last="c").worker_id == "a"  # wraps
    assert choose_worker(idle, {"a": 2}, 4, chosen_last="a").worker_id == "a"  # lower cost beats the turn
    # equal cost (b holds one block more but runs one block more), fewer active blocks wins the tie
    uneven = [view("a", active=3), view("b", active=4)]
    assert choose_worker(uneven, {"b": 1}, 4, chosen_last="a").worker_id == "a"


def test_queue_limit_rejects_only_when_every_worker_is_full():
    weights = RoutingWeights(max_waiting_per_worker=2)
    assert choose_worker([view("a", waiting=2), view("b", waiting=1)], {}, 1, weights).worker_id == "b"
    rejected = choose_worker([view("a", waiting=2), view("b", waiting=5)], {"a": 1}, 1, weights)
    assert rejected.worker_id is None


def test_round_robin_takes_the_next_usable_worker_id_whatever_it_holds():
    weights = RoutingWeights(max_waiting_per_worker=2)
    workers = [view("c"), view("a", active=90), view("b", waiting=2)]
    order = []
    last = ""
    for _ in range(4):
        choice = choose_worker(workers, {"c": 3}, 4, weights, chosen_last=last, in_turn=True)
        order.append((choice.worker_id, choice.num_overlap_blocks))
        last = choice.worker_id
    # "b" is at its queue limit; the overlap is reported for the worker chosen, never sought
    assert order == [("a", 0), ("c", 3), ("a", 0), ("c", 3)]
    assert choose_worker(workers, {}, 4, weights, chosen_last="zz", in_turn=True).worker_id == "a"  # wraps
    full = [view("a", waiting=2), view("b", waiting=3)]
    assert choose_worker(full, {}, 4, weights, in_turn=True).worker_id is None


def test_cost_arithmetic():
    w = view("a", active=5, waiting=1, unreported=2)
    choice = choose_worker([w], {"a": 1}, 4, RoutingWeights(overlap_weight=2.0, queue_weight=3.0))
    assert choice.cost == 2 * 3 + 5 + 4 + 3 * (1 + 2)


def test_unreported_admissions_steer_but_never_reject():
    weights = RoutingWeights(max_waiting_per_worker=2)
    assert choose_worker([view("a", unreported=50)], {}, 1, weights).worker_id == "a"
    assert choose_worker([view("a", unreported=3), view("b", unreported=1)], {}, 1, weights).worker_id == "b"


def info(worker_id, state="ready"):
    return WorkerInfo(worker_id=worker_id, role="decode", state=state, model="m", block_size=16,
                      max_model_len=64, generate_subject="g", cancel_subject="c")


def load(worker_id, seq, at, used=0, waiting=0):
    return WorkerLoad(worker_id=worker_id, role="decode", seq=seq, timestamp=at,
                      num_blocks_used=used, num_waiting=waiting)


def test_view_counts_admissions_until_a_later_report_includes_them():
    v = ClusterView()
    v.set_workers([info("a"), info("b", state="draining")])
    assert [e.info.worker_id for e in v.ready_workers("decode", "m")] == ["a"]
    v.update_load(load("a", 1, at=10.0, used=4), now=10.0)
    v.note_admitted("a", 3, now=11.0)
    assert v.get("a").load_view(now=11.0) == view("a", active=7, unreported=1)
    v.update_load(load("a", 1, at=12.0, used=9), now=12.0)  # stale seq: ignored
    assert v.get("a").load_view(now=12.0).num_active_blocks == 7
    v.update_load(load("a", 2, at=12.0, used=7, waiting=1), now=12.0)
    assert v.get("a").load_view(now=12.0) == view("a", active=7, waiting=1)
    v.note_admitted("a", 3, now=13.0)
    assert v.get("a").load_view(now=13.0 + 60).num_admitted_unreported == 0  # never reported: expires
    v.update_load(load("zzz", 1, at=12.0), now=12.0)  # unregistered: ignored
    v.set_workers([info("b")])
    assert v.get("a") is None
    status = v.status(now=13.0)
    assert [w.info.worker_id for w in status.workers] == ["b"]


def test_prefill_backlog_ahead_counts_own_and_higher_priorities_plus_unreported_admissions():
    v = ClusterView()
    v.set_workers([info("a")])
    v.update_load(WorkerLoad(worker_id="a", role="decode", seq=1, timestamp=10.0,
                             queued_prefill_tokens={0: 100, 1: 40, 2: 1000},
                             num_waiting_by_priority={0: 1, 2: 5}), now=10.0)
    entry = v.get("a")
    assert (entry.load.num_waiting_ahead(1), entry.load.num_waiting_ahead(2)) == (1, 6)
    assert entry.prefill_tokens_ahead(priority=1, block_size=16, now=10.0) == 140
    assert entry.prefill_tokens_ahead(priority=0, block_size=16, now=10.0) == 100
    v.note_admitted("a", 3, now=11.0)   # 3 blocks to prefill, priority unknown: ahead of everyone
    assert entry.prefill_tokens_ahead(priority=0, block_size=16, now=11.0) == 100 + 48
    assert entry.prefill_tokens_ahead(priority=0, block_size=16, now=11.0 + 60) == 100  # expired
    v.note_admitted("a", 2, now=12.0, priority=2)   # a batch admission is behind premium, not standard's
    assert entry.prefill_tokens_ahead(priority=0, block_size=16, now=12.0) == 100 + 48
    assert entry.prefill_tokens_ahead(priority=2, block_size=16, now=12.0) == 1140 + 48 + 32
    # and, counted as requests, what a new request would queue behind for a sequence slot
    assert (entry.num_admitted_ahead(0, now=12.0), entry.num_admitted_ahead(2, now=12.0)) == (1, 2)
    v.update_load(WorkerLoad(worker_id="a", role="decode", seq=2, timestamp=12.5), now=12.5)
    assert entry.num_admitted_ahead(2, now=12.6) == 0   # the report counts them now
