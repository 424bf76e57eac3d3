"""The few-row int8 CPU kernel (kernels/int8_cpu.py, kernels/cpu/int8_mm.cpp): exact int32 products,
the same bits as torch._int_mm for every row count, K not a multiple of 64, weights of any sign;
built and used on a CPU with AVX-512 VNNI; ``_int_mm`` where it cannot run."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kernels import int8_cpu
from kernels.cpu_features import cpu_flags

HAS_VNNI = all(f in cpu_flags() for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))


@pytest.fixture(autouse=True)
def _loaded():
    int8_cpu.load()  # as a quantized model's load does: int8_mm runs the kernel from here on


def test_the_kernel_is_built_and_loaded_where_the_cpu_has_vnni():
    assert int8_cpu.load() == HAS_VNNI, int8_cpu.identity()
    if HAS_VNNI:
        assert int8_cpu.identity().startswith("int8_mm-")


@pytest.mark.parametrize("k", [64, 576, 1536, 65, 100, 2047])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9, 12, 13])
def test_products_are_exact_for_any_row_count_and_width(m, k):
    gen = torch.Generator().manual_seed(m * 1000 + k)
    n = 37  # not a multiple of the kernel's 4-row tiles
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
    x[0, :3] = -128  # the extremes: x + 128 is 0, and 255 below
    x[-1, -3:] = 127
    w[0] = -128
    expected = x.int() @ w.int().t()
    got = int8_cpu.int8_mm(x, w, int8_cpu.row_sums(w))
    assert got.dtype == torch.int32 and torch.equal(got, expected)


def test_a_row_gets_the_same_bits_alone_and_among_others():
    gen = torch.Generator().manual_seed(7)
    w = torch.randint(-128, 128, (300, 576), dtype=torch.int8, generator=gen)
    x = torch.randint(-128, 128, (16, 576), dtype=torch.int8, generator=gen)
    sums = int8_cpu.row_sums(w)
    alone = int8_cpu.int8_mm(x[:1], w, sums)
    for m in range(2, 17):  # the kernel up to 12 rows (in groups of 4), _int_mm past them
        assert torch.equal(int8_cpu.int8_mm(x[:m], w, sums)[:1], alone)


@pytest.mark.skipif(not HAS_VNNI, reason="the kernel runs only on a CPU with AVX-512 VNNI")
def test_a_compiled_graph_calls_the_kernel_and_gets_its_bits():
    """The compiled decode step traces ``int8_mm`` as it runs here: the kernel's op, which needs
    the fake registered on load to be traced at all."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randint(-128, 128, (70, 200), dtype=torch.int8, generator=gen)
    sums = int8_cpu.row_sums(w)
    called = []

    def recording(gm, example_inputs):
        called.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch.compile(lambda x: int8_cpu.int8_mm(x, w, sums), backend=recording, fullgraph=True)(
        torch.zeros(2, 200, dtype=torch.int8))
    assert any("tandem_cpu.int8_mm" in target for target in called), called
    compiled = torch.compile(lambda x: int8_cpu.int8_mm(x, w, sums) * 2, fullgraph=True, dynamic=True)
    for m in (2, 3, 6, 17):
        x = torch.randint(-128, 128, (m, 200), dtype=torch.int8, generator=gen)
        assert torch.equal(compiled(x), (x.int() @ w.int().t()) * 2), m


def test_off_runs_int_mm_and_says_why():
    code = ("import os, logging; logging.basicConfig(level=logging.INFO); os.environ['TANDEM_INT8_KERNEL'] = 'off'\n"
            "from kernels import int8_cpu; import torch\n"
            "assert int8_cpu.load() is False and int8_cpu._op is None\n"
            "w = torch.randint(-128, 128, (5, 70), dtype=torch.int8); x = torch.randint(-128, 128, (1, 70), dtype=torch.int8)\n"
            "assert torch.equal(int8_cpu.int8_mm(x, w, int8_cpu.row_sums(w)), x.int() @ w.int().t())\n"
            "print(int8_cpu.identity())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "off: TANDEM_INT8_KERNEL=off"
    assert "int8 linear layers use torch._int_mm (TANDEM_INT8_KERNEL=off)" in result.stderr
