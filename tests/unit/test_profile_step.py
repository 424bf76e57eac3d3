"""The step profiler's grouping of aten ops into matmuls, attention and the rest."""

from loadtest.tools.profile_step import kind_of


def test_ops_are_grouped_by_kind():
    assert kind_of("aten::_int_mm") == "matmul"
    assert kind_of("aten::addmm") == "matmul" and kind_of("aten::mm") == "matmul"
    assert kind_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert kind_of("aten::_softmax") == "attention"
    for op in ("aten::mul", "aten::index_select", "aten::amax", "aten::mmap_like", "aten::t"):
        assert kind_of(op) == "other ops", op


def test_our_cpu_kernels_are_grouped_too():
    # the C++ ops of kernels/cpu/ are recorded under their own namespaces, beside aten's
    assert kind_of("tandem_blocks::panel_mm") == "matmul" and kind_of("tandem_blocks::block_mm") == "matmul"
    assert kind_of("tandem_cpu::int8_mm") == "matmul"
    assert kind_of("tandem_attn::decode_attention") == "attention"
    assert kind_of("tandem_prefill_attn::prefill_attention") == "attention"


def test_a_profile_splits_into_kinds_and_the_time_outside_any_op():
    """``split``: each kind's own time over the profiled time, applied to the plain time; what no op
    holds is the time outside ops; the profiler's own ranges are not ops."""
    from types import SimpleNamespace

    from loadtest.tools.profile_step import split

    events = [SimpleNamespace(key=k, self_cpu_time_total=us, count=n) for k, us, n in (
        ("tandem_blocks::panel_mm", 1200.0, 4), ("aten::_scaled_dot_product_flash_attention_for_cpu", 400.0, 2),
        ("aten::mul", 200.0, 6), ("ProfilerStep#1", 5000.0, 1))]
    prof = SimpleNamespace(key_averages=lambda: events)
    r = split(prof, 2, plain_ms=2.0, profiled_ms=1.0)  # two steps of 1 ms profiled, 2 ms plain
    assert {k: round(v, 6) for k, v in r["shares"].items()} == {
        "matmul": 0.6, "attention": 0.2, "other ops": 0.1, "outside ops (Python, dispatch)": 0.1}
    assert round(r["ms"]["matmul"], 6) == 1.2 and r["op_calls_per_step"] == 6
    assert r["top_ops"][0]["op"] == "tandem_blocks::panel_mm"
