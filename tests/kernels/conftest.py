"""Kernel tests run every Triton kernel on the CPU through the Triton interpreter.

Triton decides between interpreter and compiler when modules are *imported*: its own standard
library (``tl.zeros``, ``tl.max``, ...) as well as our kernels are decorated with ``triton.jit`` at
import time, and an interpreted kernel cannot call a compiled helper. So ``TRITON_INTERPRET=1`` must
be in the environment before the first ``import triton`` of the process. Pytest imports this file
before the test modules of this directory, and nothing outside kernels/ and loadtest/ imports
triton (``import torch`` does not), so setting it here is early enough; if something did import
triton first, the tests fail with that explanation instead of an obscure interpreter error.
Run with ``TRITON_INTERPRET=0`` on a machine with CUDA to test the compiled kernels on the GPU.
"""

import os
import sys

_TRITON_PRELOADED = "triton" in sys.modules and "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

_INTERPRET = bool(triton.knobs.runtime.interpret)


@pytest.fixture(autouse=True)
def _triton_mode_is_consistent():
    if _INTERPRET and _TRITON_PRELOADED:
        pytest.fail("triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1, so its "
                    "kernels are compiled, not interpreted; run pytest with TRITON_INTERPRET=1 exported")


@pytest.fixture(scope="session")
def device() -> torch.device:
    if not _INTERPRET:
        if not torch.cuda.is_available():
            pytest.skip("TRITON_INTERPRET=0 needs a CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")
