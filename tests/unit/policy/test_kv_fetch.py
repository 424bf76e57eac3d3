"""The pure cross-worker fetch policy: which worker to name as the prefix's source, and whether a
fetch beats recomputing."""

from shared.policy.kv_fetch import FetchConfig, HeldPrefix, choose_kv_source, decide_fetch

ALL = {"a", "b", "c"}


def test_the_source_is_the_worker_holding_the_longest_run_beyond_the_chosen_ones_own():
    held = [HeldPrefix("a", 10), HeldPrefix("b", 12, num_disk_blocks=6), HeldPrefix("c", 3)]
    choice = choose_kv_source(held, "c", ALL)
    assert (choice.worker_id, choice.num_blocks) == ("b", 12)  # it reads its disk blocks in first
    on_disk = [HeldPrefix("a", 12, num_disk_blocks=12), HeldPrefix("b", 12, num_host_blocks=4)]
    assert choose_kv_source(on_disk, "c", ALL).worker_id == "b"  # equal runs: fewer blocks on disk


def test_no_source_when_the_gain_is_under_the_minimum_or_the_holder_is_not_a_candidate():
    assert choose_kv_source([HeldPrefix("a", 4), HeldPrefix("c", 3)], "c", ALL) is None
    assert choose_kv_source([HeldPrefix("a", 4), HeldPrefix("c", 3)], "c", ALL, FetchConfig(min_blocks=1)) is not None
    assert choose_kv_source([HeldPrefix("a", 10)], "c", {"b", "c"}) is None  # a is draining or excluded
    assert choose_kv_source([HeldPrefix("c", 10)], "c", ALL) is None  # the chosen one holds it
    assert choose_kv_source([], "c", ALL) is None


def test_ties_go_to_the_lower_worker_id():
    held = [HeldPrefix("b", 8), HeldPrefix("ab", 8), HeldPrefix("a", 8)]
    assert choose_kv_source(held, "c", {"a", "ab", "b", "c"}).worker_id == "a"


def test_fetch_when_the_transfer_beats_the_prefill_rate_or_no_rate_is_known():
    block_bytes = 16 * 23_040  # SmolLM2-135M in bf16: 30 layers x 2 x 3 heads x 64 x 2 B per token
    assert decide_fetch(100, 16, block_bytes, prefill_tokens_per_s=1000.0).fetch
    assert decide_fetch(100, 16, block_bytes, prefill_tokens_per_s=None).fetch
    slow_link = decide_fetch(100, 16, block_bytes, prefill_tokens_per_s=1e6, measured_bytes_per_s=1e8)
    assert not slow_link.fetch and "no slower" in slow_link.reason
    assert not decide_fetch(1, 16, block_bytes, prefill_tokens_per_s=10.0).fetch  # under min_blocks
