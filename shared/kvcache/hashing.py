"""Chained prefix-block hashes: the one function the engine, the gateway and kv-index share.

A block's hash covers its parent's hash, the namespace (model, and optionally a LoRA name or a
cache salt) and the block's token ids. Two prompts that share their first ``k`` full blocks share
their first ``k`` hashes, and nothing else: equal hashes imply equal prefixes (up to a 2**-63
collision chance). Only full blocks are hashed; a trailing partial block has no hash.

The hash is blake2b over fixed-width little-endian bytes, so it is identical across processes,
machines and Python versions (no dependence on ``PYTHONHASHSEED``). Hashes are non-negative ints
below 2**63, so they fit a signed 64-bit integer in any language and in Redis keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BITS = 63
_MASK = (1 << HASH_BITS) - 1
# The parent of a prompt's first block: a fixed seed, distinct per namespace via the namespace bytes.
ROOT_PARENT = 0


def make_namespace(model_id: str, *, lora: str | None = None, cache_salt: str | None = None) -> bytes:
    """Namespace bytes for a model (and optional LoRA adapter / per-tenant cache salt)."""
    parts = [model_id, lora or "", cache_salt or ""]
    return "\x1f".join(parts).encode("utf-8")


def hash_block(parent_hash: int, token_ids: Sequence[int], namespace: bytes) -> int:
    """Hash one full block given its parent's hash (``ROOT_PARENT`` for the first block)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent_hash))
    h.update(struct.pack("<I", len(namespace)))
    h.update(namespace)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "little") & _MASK


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    namespace: bytes,
    *,
    parent_hash: int = ROOT_PARENT,
    start_block: int = 0,
) -> list[int]:
    """Hashes of every full block of ``token_ids`` from ``start_block`` on.

    ``parent_hash`` is the hash of block ``start_block - 1`` (or ``ROOT_PARENT`` when starting at
    block 0); this lets a caller extend an existing chain without rehashing its prefix.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[int] = []
    parent = parent_hash
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], namespace)
        hashes.append(parent)
    return hashes
