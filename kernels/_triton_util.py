"""Helpers shared by the Triton kernel wrappers and kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (the kernels then run on the CPU, through numpy)."""
    return bool(triton.knobs.runtime.interpret)


def dot_args(dtype: torch.dtype) -> dict:
    """Constexprs that choose how the attention kernels feed ``tl.dot`` and round to ``dtype``.

    float32 inputs use exact ``ieee`` products (TF32 would fail the float32 tolerances).
    The interpreter mishandles bfloat16: its ``tl.dot`` multiplies the raw uint16 bits and its
    float32 -> bfloat16 cast truncates. Under the interpreter, bfloat16 kernels therefore widen dot
    operands to float32 (exact: the GPU's bf16 products are exact in float32 too) and round to
    nearest even by hand, so that they compute what the GPU computes up to summation order.
    """
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "EMULATE_BF16": interpreting() and dtype == torch.bfloat16,
    }


@triton.jit
def attention_dot(a, b, DOT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``a @ b`` with float32 accumulation; see ``dot_args``."""
    if EMULATE_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def round_to(x, dtype: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``x.to(dtype)`` with round-to-nearest-even also under the interpreter; see ``dot_args``."""
    if EMULATE_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)  # exact: the low 16 bits are zero
    return x.to(dtype)
