"""KV write (slot_mapping scatter): Triton against the torch reference, bit for bit."""

import pytest
import torch

from kernels.kv_write import write_kv_ref
from kernels.kv_write_triton import write_kv_triton

# (block_size, num_kv_heads, head_dim, key dtype, cache dtype)
CASES = [
    (16, 2, 64, torch.float32, torch.float32),
    (32, 3, 128, torch.bfloat16, torch.bfloat16),
    (128, 8, 64, torch.float32, torch.bfloat16),
    (16, 1, 128, torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim,key_dtype,cache_dtype", CASES)
def test_write_kv_matches_reference(device, block_size, num_kv_heads, head_dim, key_dtype, cache_dtype):
    num_blocks = 6
    pool = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim)
    pool = pool.to(dtype=cache_dtype, device=device)
    expected = pool.clone()
    # first and last slot of a block, the next block's first, the pool's last slot, a few in the middle
    slots = [0, block_size - 1, block_size, num_blocks * block_size - 1, 2 * block_size + 5,
             4 * block_size + 1]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    # key and value as slices of a fused [T, 3, Hkv, D] projection: strided, like the model's
    qkv = torch.randn(len(slots), 3, num_kv_heads, head_dim).to(dtype=key_dtype, device=device)
    key, value = qkv[:, 1], qkv[:, 2]

    write_kv_ref(key, value, expected[:, 1, 0], expected[:, 1, 1], slot_mapping)
    write_kv_triton(key, value, pool[:, 1, 0], pool[:, 1, 1], slot_mapping)
    assert torch.equal(pool, expected)  # includes every slot and layer not written


def test_padding_rows_write_nothing(device):
    """A negative slot (a row that pads a CUDA graph's batch) writes nothing, in both versions:
    the pool ends as if only the real rows had been written."""
    block_size, num_kv_heads, head_dim = 16, 2, 64
    pool = torch.randn(4, 2, 2, block_size, num_kv_heads, head_dim, device=device)
    original, ref_pool, expected = pool.clone(), pool.clone(), pool.clone()
    slot_mapping = torch.tensor([-1, 3, -1, 2 * block_size + 7, -1], dtype=torch.int64, device=device)
    qkv = torch.randn(5, 3, num_kv_heads, head_dim, device=device)
    key, value = qkv[:, 1], qkv[:, 2]
    real = [1, 3]
    write_kv_ref(key[real], value[real], expected[:, 1, 0], expected[:, 1, 1], slot_mapping[real])
    write_kv_ref(key, value, ref_pool[:, 1, 0], ref_pool[:, 1, 1], slot_mapping)
    write_kv_triton(key, value, pool[:, 1, 0], pool[:, 1, 1], slot_mapping)
    assert not torch.equal(expected, original)  # the real rows were written
    assert torch.equal(ref_pool, expected)
    assert torch.equal(pool, expected)


def test_write_kv_empty_step_is_a_no_op(device):
    pool = torch.randn(2, 1, 2, 16, 1, 64, device=device)
    before = pool.clone()
    empty = torch.empty(0, 1, 64, device=device)
    no_slots = torch.empty(0, dtype=torch.int64, device=device)
    write_kv_triton(empty, empty, pool[:, 0, 0], pool[:, 0, 1], no_slots)
    assert torch.equal(pool, before)
