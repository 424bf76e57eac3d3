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
