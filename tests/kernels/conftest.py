"""Kernel tests run every Triton kernel on the CPU through the Triton interpreter.

``triton.jit`` picks interpreted or compiled when a kernel is *defined* (module import), so the
variable must be set before any ``kernels.*_triton`` module is imported. Pytest imports this file
before the test modules of this directory; a Triton module that something else imported earlier
(outside tests/kernels) is reloaded so that its kernels are defined again, interpreted.
Run with ``TRITON_INTERPRET=0`` on a machine with CUDA to test the compiled kernels on the GPU.
"""

import importlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

_INTERPRET = bool(triton.knobs.runtime.interpret)

if _INTERPRET:
    for _name in sorted(sys.modules):
        if _name.startswith("kernels.") and (_name.endswith("_triton") or _name == "kernels._triton_util"):
            importlib.reload(sys.modules[_name])
    if "kernels.backend" in sys.modules:
        importlib.reload(sys.modules["kernels.backend"])


@pytest.fixture(scope="session")
def device() -> torch.device:
    if not _INTERPRET:
        if not torch.cuda.is_available():
            pytest.skip("TRITON_INTERPRET=0 needs a CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")
