"""Rotary position embedding (rotate-half / NeoX form) of a step's queries and keys.

The model's rotary (through shared/model/attention.py). Products and sums are computed in the
promoted dtype of x and cos/sin, rounding after each operation as torch does, then cast to x's
dtype. ``cos``/``sin`` are per token (``[T, D/2]``), so positions may be arbitrary.
"""

from __future__ import annotations

import torch

from kernels.cast import cast


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return cast(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1), x.dtype)


def rotary_embedding_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D/2]
    sin: torch.Tensor,  # [T, D/2]
) -> tuple[torch.Tensor, torch.Tensor]:  # (q rotated [T, Hq, D], k rotated [T, Hkv, D])
    if q.dtype != k.dtype:
        return _rotate(q, cos, sin), _rotate(k, cos, sin)
    # one rotation over the heads of both: the same values, half the op calls
    return _rotate(torch.cat((q, k), dim=1), cos, sin).split([q.shape[1], k.shape[1]], dim=1)
