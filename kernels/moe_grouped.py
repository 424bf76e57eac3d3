"""A grouped linear layer for a mixture of experts: the rows of a batch, already grouped by
expert, each multiplied by its expert's weight, for every expert in one call.

Rows ``p`` of expert ``e`` are the ``counts[e]`` consecutive rows that follow the rows of experts
``0 .. e - 1`` (the offsets are the exclusive prefix sum of ``counts``). Row ``p`` reads input row
``rows[p]`` (a gather, so the caller need not permute its activations; without ``rows``, x's rows
are the P rows in order), and ``out[p] = x[rows[p]] @ weight[e]^T``, rounded to x's dtype as ``F.linear`` rounds,
then times ``scale[p]`` where given (the routing weight on an expert's down projection) in the
promoted dtype of x and scale.

This module is the torch reference (a loop over the experts, with one host sync for the counts);
``moe_grouped_triton.py`` is the kernel with the same contract, one launch and no host sync. With
``linear`` in place of ``F.linear`` the loop multiplies weights of another format: int8 experts on
the CPU (``shared/model/moe.py``'s ``Int8Experts``, each expert's rows through the dense layers'
int8 linear) run this loop as their grouped path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def grouped_linear_ref(
    x: torch.Tensor,  # [R, K]: the input rows (R = P, in order, where rows is None)
    weight: torch.Tensor,  # [E, N, K]: each expert's weight, as F.linear (or ``linear``) takes weight[e]
    counts: torch.Tensor,  # [E] int: rows per expert, summing to P
    rows: torch.Tensor | None = None,  # [P] int: the input row of each output row
    scale: torch.Tensor | None = None,  # [P]: a factor per output row
    linear: Callable[..., torch.Tensor] = F.linear,  # (block [n, K], weight[e]) -> [n, N] in block's dtype
) -> torch.Tensor:  # [P, N], x's dtype promoted with scale's
    num_rows = x.shape[0] if rows is None else rows.shape[0]
    out_dtype = x.dtype if scale is None else torch.promote_types(x.dtype, scale.dtype)
    out = torch.empty(num_rows, weight.shape[1], dtype=out_dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        block = x[start:start + count] if rows is None else x.index_select(0, rows[start:start + count])
        y = linear(block, weight[expert])
        out[start:start + count] = y if scale is None else y * scale[start:start + count, None]
        start += count
    assert start == num_rows, f"counts sum to {start}, not the {num_rows} rows"
    return out
