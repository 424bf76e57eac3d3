"""The eager step's small ops fused on a CPU with AVX-512F (``kernels/cpu/fused_ops.cpp``): the
residual add + RMSNorm, the rotate-half rotary embedding and SiLU(gate) * up, one pass over a row
each instead of torch's chain of elementwise ops (in a prompt step of 2 x 1,000 tokens those ops were
a fifth of the time: ``loadtest/tools/profile_step.py --prompts``).

Every output row is a function of its own input row alone, so batch-mates and chunking cannot move
its bits. Rotary gives torch's bits; the norm's sum of squares and SiLU's exponential are our own
order and polynomial, so they differ from the references (``kernels/rms_norm.py``, ``rotary.py``,
torch's ``silu``) in the last bits, and the engine uses one or the other for a whole run (``identity``
says which). Float32 activations only; any other dtype, device or layout takes the reference. Built
on first use; ``TANDEM_FUSED_OPS_KERNEL=off``, no compiler or no AVX-512F keeps torch's ops, and a
log line says why. The compiled decode step keeps inductor's own fusion of the same ops.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cpu_build import CpuKernel
from kernels.rms_norm import fused_add_rms_norm_ref
from kernels.rotary import rotary_embedding_ref

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu" / "fused_ops.cpp"
_FLAGS = ["-mavx512f", "-mavx512dq", "-mavx2", "-mfma", "-ffp-contract=off"]
_NEEDS = ("avx512f", "avx512dq", "avx2", "fma")
_op = None  # torch.ops.tandem_fused.add_rms_norm once loaded (the namespace's first op)


def _fake(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


_KERNEL = CpuKernel(SOURCE, _FLAGS, "tandem_fused::add_rms_norm", _fake, "TANDEM_FUSED_OPS_KERNEL", _NEEDS,
                    module=globals(), fallback="reference", say=log.warning,
                    message="eager steps run torch's RMSNorm, rotary and SiLU ops (%s)")


def load() -> bool:
    """Build (once per machine) and load the ops; False (and why, logged once) where they cannot run.
    Nothing traces them (the compiled decode step has its own norm, rotary and SiLU), so only the
    first op has shapes for tracing, which ``CpuKernel`` asks of every kernel."""
    return _KERNEL.load()


def identity() -> str:
    """What the eager small ops run on here: the kernel's build name, or "reference: " and why."""
    return _KERNEL.describe()


def _rows(t: torch.Tensor) -> bool:  # float32 [T, H] on the CPU, each row's values contiguous
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.stride(-1) == 1


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.rms_norm.fused_add_rms_norm_ref``: (normed [T, H], x + residual [T, H])."""
    if (_rows(x) and (residual is None or (_rows(residual) and residual.shape == x.shape))
            and weight.dtype == torch.float32 and weight.dim() == 1 and load()):
        return torch.ops.tandem_fused.add_rms_norm(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def _heads(t: torch.Tensor) -> bool:  # float32 [T, heads, D] on the CPU, each head's values contiguous
    return (t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 3 and t.stride(2) == 1
            and t.stride(1) == t.shape[2])


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.rotary.rotary_embedding_ref``, the same bits: (q rotated, k rotated)."""
    if (_heads(q) and _heads(k) and cos.dtype == torch.float32 and sin.dtype == torch.float32
            and q.shape[2] % 2 == 0 and load()):
        return torch.ops.tandem_fused.rotary(q, k, cos, sin)
    return rotary_embedding_ref(q, k, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of ``[T, 2I]`` rows, gate the first ``I`` columns: ``[T, I]``."""
    if _rows(gate_up) and gate_up.shape[1] % 2 == 0 and load():
        return torch.ops.tandem_fused.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
