"""KV gather / scatter of whole pool rows: Triton against the torch reference, bit for bit."""

import pytest
import torch

from kernels.kv_gather import gather_kv_blocks_ref, scatter_kv_blocks_ref
from kernels.kv_gather_triton import gather_kv_blocks_triton, scatter_kv_blocks_triton

# (num_layers, block_size, num_kv_heads, head_dim, dtype); a row of the last case (19200 values)
# is not a multiple of the kernel's chunk, so the tail mask is exercised.
CASES = [
    (2, 16, 2, 64, torch.float32),
    (1, 32, 3, 128, torch.bfloat16),
    (1, 128, 1, 64, torch.float8_e4m3fn),
    (3, 16, 2, 100, torch.bfloat16),
]


def _pool(num_blocks, num_layers, block_size, num_kv_heads, head_dim, dtype, device):
    pool = torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    return pool.to(dtype=dtype, device=device)


@pytest.mark.parametrize("num_layers,block_size,num_kv_heads,head_dim,dtype", CASES)
def test_gather_then_scatter_matches_reference(device, num_layers, block_size, num_kv_heads, head_dim, dtype):
    src = _pool(8, num_layers, block_size, num_kv_heads, head_dim, dtype, device)
    src_ids = [5, 0, 1, 7]  # out of order, one consecutive run
    slab = gather_kv_blocks_triton(src, src_ids)
    expected_slab = gather_kv_blocks_ref(src, src_ids)
    assert slab.is_contiguous() and slab.shape == (4, *src.shape[1:])
    assert torch.equal(slab.view(torch.uint8), expected_slab.view(torch.uint8))

    dst = _pool(6, num_layers, block_size, num_kv_heads, head_dim, dtype, device)
    expected_dst = dst.clone()
    dst_ids = torch.tensor([3, 2, 0, 4], device=device)
    scatter_kv_blocks_triton(slab, dst, dst_ids)
    scatter_kv_blocks_ref(expected_slab, expected_dst, dst_ids)
    assert torch.equal(dst.view(torch.uint8), expected_dst.view(torch.uint8))  # block 1 and 5 untouched


def test_gather_into_out_and_empty(device):
    src = _pool(4, 2, 16, 1, 64, torch.bfloat16, device)
    out = torch.empty((2, *src.shape[1:]), dtype=src.dtype, device=device)
    assert gather_kv_blocks_triton(src, torch.tensor([3, 1], device=device), out=out) is out
    assert torch.equal(out, src[[3, 1]])
    assert gather_kv_blocks_triton(src, []).shape == (0, *src.shape[1:])
    before = src.clone()
    scatter_kv_blocks_triton(out[:0], src, [])
    assert torch.equal(src, before)


def test_device_dispatch_uses_the_reference_off_cuda():
    from kernels.dispatch import gather_kv_blocks

    pool = torch.randn(4, 1, 2, 16, 1, 64)
    assert torch.equal(gather_kv_blocks(pool, [2, 0]), pool[[2, 0]])
