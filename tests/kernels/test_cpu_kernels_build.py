"""Every C++ CPU kernel builds and loads wherever this CPU has the flags it needs and its switch is on.

Each kernel's own tests skip where it cannot run, and the engine falls back to torch with a log line:
so a kernel whose build broke (a source or a shared header that no longer compiles with its flags)
would only show as a slower step. Here that is a failure, with the compiler's words."""

from __future__ import annotations

import importlib

import pytest

from kernels.cpu_build import why_not

MODULES = ["kernels.attention_cpu", "kernels.prefill_attention", "kernels.fused_cpu", "kernels.blocks_cpu",
           "kernels.int8_cpu"]


@pytest.mark.parametrize("name", MODULES)
def test_the_kernel_builds_where_the_cpu_has_what_it_needs(name):
    module = importlib.import_module(name)
    kernel = module._KERNEL
    _source, _flags, _op, _fake, switch, needs = kernel._args
    if (why := why_not(switch, needs)) is not None:
        pytest.skip(f"{name} does not run here: {why}")
    assert module.load(), f"{name} did not build or load: {module.identity()}"
    assert not module.identity().startswith(kernel._fallback), module.identity()
