"""Fused residual add + RMSNorm and rotary embedding: Triton against the torch references (which
the model itself runs on the CPU; tests/unit/engine/test_model_vs_transformers.py checks them
against transformers through the model)."""

import pytest
import torch

from kernels.rms_norm import fused_add_rms_norm_ref
from kernels.rms_norm_triton import fused_add_rms_norm_triton
from kernels.rotary import rotary_embedding_ref
from kernels.rotary_triton import rotary_embedding_triton

# One bf16 ulp (2**-8 relative) for bf16, summation order for float32: the GPU may contract a
# multiply-add into an FMA or sum in another order; the interpreter matches bit for bit.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-8, atol=1e-3)}


def _rope_tables(num_tokens: int, head_dim: int, dtype: torch.dtype, device):
    positions = torch.tensor([0, 1, 2, 17, 500, 4095, 8191][:num_tokens], dtype=torch.float32)
    inv_freq = 500000.0 ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = positions[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype=dtype, device=device), freqs.sin().to(dtype=dtype, device=device)


@pytest.mark.parametrize("hidden,dtype,weight_dtype,with_residual", [
    (64, torch.float32, torch.float32, True),
    (96, torch.bfloat16, torch.bfloat16, True),  # not a power of two: masked tail
    (4096, torch.bfloat16, torch.bfloat16, False),
    (128, torch.bfloat16, torch.float32, True),  # weight dtype promotes the output
])
def test_fused_add_rms_norm_matches_reference(device, hidden, dtype, weight_dtype, with_residual):
    x = (torch.randn(5, hidden) * 3).to(dtype=dtype, device=device)
    residual = torch.randn(5, hidden).to(dtype=dtype, device=device) if with_residual else None
    weight = torch.rand(hidden).add(0.5).to(dtype=weight_dtype, device=device)
    out, summed = fused_add_rms_norm_triton(x, residual, weight, 1e-5)
    out_ref, summed_ref = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert out.dtype == out_ref.dtype and summed.dtype == summed_ref.dtype
    assert torch.equal(summed, summed_ref)
    torch.testing.assert_close(out, out_ref, **TOL[out_ref.dtype])


@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads,dtype,table_dtype", [
    (64, 4, 4, torch.float32, torch.float32),
    (128, 24, 8, torch.bfloat16, torch.bfloat16),  # GQA 3, as the model passes them
    (64, 8, 1, torch.bfloat16, torch.float32),
])
def test_rotary_matches_reference(device, head_dim, num_q_heads, num_kv_heads, dtype, table_dtype):
    num_tokens = 7
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim).to(dtype=dtype, device=device)
    q, k = qkv[:, :num_q_heads], qkv[:, num_q_heads:num_q_heads + num_kv_heads]  # strided views
    cos, sin = _rope_tables(num_tokens, head_dim, table_dtype, device)
    q_rot, k_rot = rotary_embedding_triton(q, k, cos, sin)
    q_ref, k_ref = rotary_embedding_ref(q, k, cos, sin)
    torch.testing.assert_close(q_rot, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_rot, k_ref, **TOL[dtype])
    # position 0 is the identity: catches a swapped cos/sin or a sign error on its own
    torch.testing.assert_close(q_rot[0], q[0], rtol=0, atol=0)

