"""Paged prefill/extend attention: ragged query lengths over a cached prefix, causal.

Sequence ``i`` owns queries ``q[query_start_loc[i]:query_start_loc[i+1]]``; they are the *last*
``q_len`` positions of its ``seq_lens[i]``-token context, whose K/V (including the new tokens')
is already in the cache.

The reference computes each query's attention in the same call, whatever chunk of the prompt it
came in: queries go to SDPA in tiles of ``QUERY_TILE`` positions aligned to the start of the
sequence, each tile over the keys up to its own end (a query of an earlier chunk, or past the
chunk's end, fills its row with zeros and is dropped). A tile's call is then a function of the tile
alone, and so is every row of it: how the scheduler splits a prompt into chunks, which depends on
its batch-mates, cannot move a bit of the result. SDPA's result for a row otherwise depends on
which rows share its call and on how many keys are padded after it, and with int8 linear layers a
last-bit difference can flip an activation's rounding and change a greedy token.

With a sliding ``window``, the query at position ``p`` sees the keys in ``(p - window, p]`` (its
last ``window`` positions, its own included, as transformers' ``sliding_window_overlay``): one
more term of the mask, and a tile's call reads the keys from the first its first query sees on,
so it stays a function of the tile (and the window).

On a CPU with AVX-512F, ``paged_prefill_attention`` runs ``kernels/cpu/prefill_attention.cpp``
instead: it reads the pool in place and computes each query row from its own query and visible keys
alone (scores summed over the head dimension in order, keys in lanes fixed by their absolute
position, unseen keys an exact 0), so a row's bits do not depend on the chunking, the batch or the
tile at all, and its sums are float32 throughout. The torch backend then sends it the eager decode
rows too, each a sequence of one query: a token's attention is the same function whether its row
was prefilled or decoded (the decode reference pads every row to the step's longest, and SDPA's last
bits moved with that padding). It differs from the references in the last bits (the SDPA kernel's
order of sums is its own), so the engine uses one or the other for a whole run (``identity`` says
which). Built on first use (``kernels/cpu_build.py``); with
``TANDEM_PREFILL_ATTENTION_KERNEL=off``, without a compiler or without AVX-512F, the reference runs
and a log line says why.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cpu_build import CpuKernel

log = logging.getLogger(__name__)

# positions per SDPA call (torch's CPU kernel splits them in 32s). Any fixed size keeps each call a function of
# its tile; a prompt shorter than a tile pays for the whole tile, and 64 cost less than 128 at every length
# measured (16 to 2,000 tokens; loadtest/results/README.md, "Batch-invariant attention")
QUERY_TILE = 64


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, M] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    tile: int = QUERY_TILE,  # another size gives other bits: the engine keeps to QUERY_TILE
    window: int | None = None,  # sliding window: each query sees its last ``window`` positions
) -> torch.Tensor:  # [T, Hq, D]
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        table = block_tables[i, :num_blocks].long()
        first = seq_len - q_len  # position of the first query
        length = -(-seq_len // tile) * tile  # keys up to the end of the last tile
        k = q.new_zeros(length, num_kv_heads, head_dim)  # past seq_len: zeros, never NaN from the pool
        v = q.new_zeros(length, num_kv_heads, head_dim)
        k[:seq_len] = k_cache[table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v[:seq_len] = v_cache[table].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, length, D]
        for a in range(first // tile * tile, seq_len, tile):
            b = a + tile
            lo, hi = max(a, first), min(b, seq_len)
            rows = q[q_start + lo - first:q_start + hi - first]  # [hi - lo, Hq, D]
            if hi - lo < tile:
                rows = torch.cat([rows.new_zeros(lo - a, *rows.shape[1:]), rows,
                                  rows.new_zeros(b - hi, *rows.shape[1:])])
            # the keys from the first one the tile's first query sees (a function of the tile and the window)
            k_lo = 0 if window is None else max(a - window + 1, 0)
            q_pos = torch.arange(a, b, device=q.device)
            keys = torch.arange(k_lo, b, device=q.device)[None, :]
            mask = keys <= q_pos[:, None]  # [tile, b - k_lo]
            if window is not None:
                mask &= keys > q_pos[:, None] - window
            o = F.scaled_dot_product_attention(rows.transpose(0, 1)[None], k[None, :, k_lo:b], v[None, :, k_lo:b],
                                               attn_mask=mask, scale=scale, enable_gqa=True)  # [1, Hq, tile, D]
            out[q_start + lo - first:q_start + hi - first] = o[0, :, lo - a:hi - a].transpose(0, 1)
    return out


SOURCE = Path(__file__).parent / "cpu" / "prefill_attention.cpp"
_FLAGS = ["-mavx512f", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]
_NEEDS = ("avx512f", "avx2", "fma", "f16c")
POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_op = None  # torch.ops.tandem_prefill_attn.prefill_attention once loaded


def _fake(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window, tile):
    return torch.empty_like(q)


_KERNEL = CpuKernel(SOURCE, _FLAGS, "tandem_prefill_attn::prefill_attention", _fake,
                    "TANDEM_PREFILL_ATTENTION_KERNEL", _NEEDS, module=globals(), fallback="reference",
                    say=log.warning,
                    message="eager attention runs torch's SDPA tiles and the padded decode reference (%s)")


def load() -> bool:
    """Build (once per machine) and load the kernel; False (and why, logged once) where it cannot run."""
    return _KERNEL.load()


def identity() -> str:
    """What prefill attention runs on a CPU here: the kernel's build name, or "reference: " and why."""
    return _KERNEL.describe()


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel serves these tensors (loading it on first call): a CPU pool of a dtype it
    reads, float32 queries, a head of 16 to 128 values in 16s, a block's rows contiguous."""
    head_dim = q.shape[-1]
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype in POOL_DTYPES
            and head_dim % 16 == 0 and head_dim <= 128 and k_cache.stride(-1) == 1
            and k_cache.stride(-2) == head_dim and k_cache.stride(-3) == head_dim * k_cache.shape[-2]
            and load())


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, window: int | None = None) -> torch.Tensor:
    """``paged_prefill_attention_ref``'s inputs and result: the CPU kernel where ``usable``, else the
    reference (CUDA tensors go to the Triton kernel through the Triton backend, not here)."""
    if usable(q, k_cache):
        return kernel_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                       window=window)


def kernel_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """The CPU kernel itself, for a caller that asked ``usable`` already (the torch backend, every layer)."""
    return _op(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window or 0, QUERY_TILE)
