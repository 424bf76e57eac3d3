"""Int8 matrix products for few rows on a CPU with AVX-512 VNNI: ``kernels/cpu/int8_mm.cpp``.

The reference is ``torch._int_mm(x, w.t())``: both are exact int32 sums, so ``int8_mm`` returns the
same bits whichever runs, and a machine without the kernel computes what one with it does. At batch
1 a decode step's int8 linear layers are a stream of weight bytes; on the Intel Xeon measured (2
threads, a 1B model's layers), ``_int_mm`` (oneDNN) read them at 11-13 GB/s, about half of a plain
read's 23-24, and the kernel at 16-19 for one to three rows: 1.25-1.55x
(``python -m loadtest.bench.int8_kernel``, loadtest/results/README.md).

Eager steps and the compiled decode step both call it: the graph calls ``tandem_cpu::int8_mm``
where the kernel is loaded (its fake, registered on load, gives the graph the output's shape), and
``_int_mm`` where it is not, so the compiled step's artifacts name which one they call
(``kernel_in_graph``). On the 1B model here the compiled batch-1 step went from 124-125 to 78-104
ms with it.
It is C++ built on first use with the compiler inductor uses (``CXX`` or ``c++``), against
the installed torch, into ``TANDEM_CACHE_DIR/kernels/`` under a name that covers its source, torch's
version and the flags; a later process loads it in milliseconds. Without VNNI, without a compiler,
or with ``TANDEM_INT8_KERNEL=off``, ``int8_mm`` is ``_int_mm`` and a log line says why.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kernels.cpu_build import CpuKernel
from kernels.cpu_features import AVX512_VNNI_FLAGS

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu" / "int8_mm.cpp"
_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
_NEEDS = AVX512_VNNI_FLAGS
_op = None  # torch.ops.tandem_cpu.int8_mm once loaded (a global: torch.compile traces the call)


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch._int_mm(x, w.t())


def identity() -> str:
    """What ``int8_mm`` runs here: the kernel's build name, or "off: " and why."""
    return _KERNEL.describe()


def int8_mm(x: torch.Tensor, w: torch.Tensor, w_sums: torch.Tensor) -> torch.Tensor:
    """x [M, K] int8 @ w [N, K].T int8 -> int32 [M, N], exact; ``w_sums`` [N] int32 is w's row sums.
    The kernel once ``load()`` has loaded it (the model's ``quantize`` does), else ``_int_mm``; the
    kernel itself hands more than four rows to ``_int_mm``. Traced into the compiled decode step as
    it runs here (``kernel_in_graph``)."""
    if _op is not None and x.device.type == "cpu":
        return _op(x, w, w_sums)
    return _reference(x, w)


def kernel_in_graph() -> bool:
    """Whether a decode step compiled in this process calls the kernel (else ``_int_mm``): part of
    the compiled step's artifact key, since a graph that calls the kernel needs it loaded."""
    return load()


def _fake_int8_mm(x: torch.Tensor, w: torch.Tensor, w_sums: torch.Tensor) -> torch.Tensor:
    """The kernel's output for tracing: shape and dtype, no data."""
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.int32)


def row_sums(w: torch.Tensor) -> torch.Tensor:
    return w.sum(dim=1, dtype=torch.int32)


def load() -> bool:
    """Build (once per machine) and load the kernel; False (and why, logged once) where it cannot run."""
    return _KERNEL.load()


_KERNEL = CpuKernel(SOURCE, _FLAGS, "tandem_cpu::int8_mm", _fake_int8_mm, "TANDEM_INT8_KERNEL", _NEEDS,
                    module=globals(), fallback="off", say=log.info, message="int8 linear layers use torch._int_mm (%s)")
