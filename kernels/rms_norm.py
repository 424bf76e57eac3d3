"""RMSNorm with the residual add fused in front (the pre-norm of every Llama sublayer).

The model's norm (through shared/model/attention.py). Numerics follow transformers'
``LlamaRMSNorm``: the residual sum is rounded to the activation dtype, the norm is computed in
float32, rounded to the activation dtype, then scaled by the weight (in the promoted dtype of
weight and activations).
"""

from __future__ import annotations

import torch

from kernels.cast import cast


def fused_add_rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H], x's dtype; None for the first layer
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, H], new residual = x + residual [T, H])
    summed = x if residual is None else x + residual
    xf = cast(summed, torch.float32)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * cast(normed, x.dtype), summed
