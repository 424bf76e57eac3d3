"""RMSNorm with the residual add fused in front (the pre-norm of every Llama sublayer).

The model's norm (through shared/model/attention.py). Numerics follow transformers'
``LlamaRMSNorm``: the residual sum is rounded to the activation dtype, the norm is computed in
float32, rounded to the activation dtype, then scaled by the weight (in the promoted dtype of
weight and activations).
"""

from __future__ import annotations

import torch


def fused_add_rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor | None,  # [T, H], x's dtype; None for the first layer
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, H], new residual = x + residual [T, H])
    summed = x if residual is None else x + residual
    xf = summed if summed.dtype == torch.float32 else summed.float()  # (skipping no-op casts saves a
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # dispatch each, per layer)
    return weight * (normed if normed.dtype == x.dtype else normed.to(x.dtype)), summed
