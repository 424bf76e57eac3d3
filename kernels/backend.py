"""The Triton backend: the same protocol as ``TorchAttentionBackend`` (shared/model/attention.py),
with the kernels of this package.

A step's decode sequences (first in the batch) go through the split-K decode kernel, its prefill
chunks through the prefill kernel; both write into one output tensor, so there is no concatenation.
The metadata's ``max_seq_len`` / ``max_query_len`` bound the launch grids without a host sync.
"""

from __future__ import annotations

import torch

from kernels.decode_attention_triton import paged_decode_attention_triton
from kernels.kv_write_triton import write_kv_triton
from kernels.prefill_attention_triton import paged_prefill_attention_triton
from kernels.rms_norm_triton import fused_add_rms_norm_triton
from kernels.rotary_triton import rotary_embedding_triton


class TritonAttentionBackend:
    name = "triton"

    def write_kv(self, key, value, k_cache, v_cache, meta) -> None:
        write_kv_triton(key, value, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
               scale: float, window: int | None = None) -> torch.Tensor:
        num_decodes = meta.num_decodes
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
        if num_decodes:
            paged_decode_attention_triton(
                q[:num_decodes], k_cache, v_cache, meta.block_tables[:num_decodes],
                meta.seq_lens[:num_decodes], scale, max_seq_len=meta.max_seq_len, out=out[:num_decodes],
                window=window)
        if q.shape[0] > num_decodes:
            query_start_loc = meta.query_start_loc[num_decodes:] - num_decodes
            paged_prefill_attention_triton(
                q[num_decodes:], k_cache, v_cache, meta.block_tables[num_decodes:], query_start_loc,
                meta.seq_lens[num_decodes:], scale, max_query_len=meta.max_query_len, out=out[num_decodes:],
                window=window)
        return out

    def fused_add_rms_norm(self, x, residual, weight, eps):
        return fused_add_rms_norm_triton(x, residual, weight, eps)

    def rotary_embedding(self, q, k, cos, sin):
        return rotary_embedding_triton(q, k, cos, sin)
