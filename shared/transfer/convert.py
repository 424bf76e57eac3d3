"""Layout conversion between pools whose block size or dtype differ.

Both pools share the row layout ``[L, 2, block_size, Hkv, D]`` per block, so a conversion is a
re-blocking of the token axis plus a cast, done on a gathered slab before it is written. Layers,
heads and head_dim must match (a tensor-parallel split would change heads: not covered yet).
"""

from __future__ import annotations

import torch

from shared.kvcache.layout import KvCacheSpec
from shared.transfer.base import KvLayoutMismatch, describe_spec


def check_convertible(local: KvCacheSpec, remote: KvCacheSpec) -> None:
    """Raise ``KvLayoutMismatch`` naming both layouts unless only block size / dtype differ."""
    same_shape = (local.num_layers, local.num_kv_heads, local.head_dim) == \
        (remote.num_layers, remote.num_kv_heads, remote.head_dim)
    if not same_shape:
        raise KvLayoutMismatch(
            f"cannot convert KV layout {describe_spec(local)} into {describe_spec(remote)}: layers, KV heads "
            "and head_dim must match (only block size and dtype are converted)")


def needs_conversion(local: KvCacheSpec, remote: KvCacheSpec) -> bool:
    return local.block_size != remote.block_size or local.dtype != remote.dtype


def num_tokens_moved(local: KvCacheSpec, remote: KvCacheSpec, num_local: int, num_remote: int) -> int:
    """Tokens carried by ``num_local`` local blocks into ``num_remote`` remote ones: neither side may
    hold a block that receives no token (otherwise the pairing of blocks is ambiguous)."""
    num_tokens = min(num_local * local.block_size, num_remote * remote.block_size)
    if -(-num_tokens // local.block_size) != num_local or -(-num_tokens // remote.block_size) != num_remote:
        raise KvLayoutMismatch(
            f"{num_local} blocks of {local.block_size} tokens do not map onto {num_remote} blocks of "
            f"{remote.block_size} tokens ({describe_spec(local)} -> {describe_spec(remote)})")
    return num_tokens


def convert_slab(
    slab: torch.Tensor,  # [n_local, L, 2, bs_local, Hkv, D], local dtype
    local: KvCacheSpec,
    remote: KvCacheSpec,
    num_remote_blocks: int,
    out: torch.Tensor | None = None,  # [n_remote, L, 2, bs_remote, Hkv, D], remote dtype
) -> torch.Tensor:  # [n_remote, L, 2, bs_remote, Hkv, D], remote dtype; tail past the tokens is zero
    check_convertible(local, remote)
    num_local = slab.shape[0]
    num_tokens = num_tokens_moved(local, remote, num_local, num_remote_blocks)
    L, H, D, bs = remote.num_layers, remote.num_kv_heads, remote.head_dim, remote.block_size
    if out is None:
        out = torch.empty((num_remote_blocks, L, 2, bs, H, D), dtype=remote.dtype, device=slab.device)
    if local.block_size == remote.block_size:
        out.copy_(slab)
        return out
    # tokens: [L, 2, T, H, D] in order, then re-blocked; the remote tail is zero-filled
    tokens = slab.permute(1, 2, 0, 3, 4, 5).reshape(L, 2, num_local * local.block_size, H, D)[:, :, :num_tokens]
    out.zero_()
    out_tokens = out.permute(1, 2, 0, 3, 4, 5)  # [L, 2, n_remote, bs, H, D], a view of out
    full, rest = divmod(num_tokens, bs)
    if full:
        out_tokens[:, :, :full].copy_(tokens[:, :, :full * bs].reshape(L, 2, full, bs, H, D))
    if rest:
        out_tokens[:, :, full, :rest].copy_(tokens[:, :, full * bs:])
    return out
