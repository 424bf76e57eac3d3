"""The eager step's fused CPU ops (kernels/cpu/fused_ops.cpp) against float64 and torch's ops: each row a
function of its own input alone, rotary torch's bits exactly, and the references wherever they cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import fused_cpu
from kernels.rms_norm import fused_add_rms_norm_ref
from kernels.rotary import rotary_embedding_ref


@pytest.fixture(autouse=True)
def _kernel_here():
    if not fused_cpu.load():
        pytest.skip(f"no fused CPU ops here: {fused_cpu.identity()}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("hidden", [16, 64, 576, 1000])  # 1000: a row that ends in a partial vector
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_norm_is_rmsnorm_of_the_sum(hidden, with_residual):
    g = _gen(hidden)
    x = torch.randn(37, hidden, generator=g) * 3
    residual = torch.randn(37, hidden, generator=g) if with_residual else None
    weight = torch.randn(hidden, generator=g)
    normed, summed = fused_cpu.add_rms_norm(x, residual, weight, 1e-5)
    s64 = x.double() + (residual.double() if with_residual else 0)
    want = weight.double() * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(summed, x + residual if with_residual else x)
    assert (normed.double() - want).abs().max() <= 1e-5 * want.abs().max()
    ref = fused_add_rms_norm_ref(x, residual, weight, 1e-5)[0]
    assert (normed - ref).abs().max() <= 4 * torch.finfo(torch.float32).eps * ref.abs().max()


def test_rotary_gives_the_references_bits_on_strided_heads():
    g = _gen(1)
    qkv = torch.randn(29, 9 * 64 + 2 * 3 * 64, generator=g)  # q and k are views into one projection's rows
    q, k = qkv[:, :576].view(29, 9, 64), qkv[:, 576:768].view(29, 3, 64)
    cos, sin = torch.randn(29, 32, generator=g), torch.randn(29, 32, generator=g)
    got, want = fused_cpu.rotary(q, k, cos, sin), rotary_embedding_ref(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(q, qkv[:, :576].view(29, 9, 64))  # inputs left as they were


@pytest.mark.parametrize("inner", [16, 1536, 1000])
def test_silu_mul_is_silu_of_gate_times_up(inner):
    g = _gen(inner)
    gate_up = torch.randn(23, 2 * inner, generator=g) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # past the exponential's clamp both ways
    got = fused_cpu.silu_mul(gate_up)
    g64, u64 = gate_up.double().chunk(2, dim=-1)
    want = g64 * torch.sigmoid(g64) * u64
    assert ((got.double() - want).abs() <= 4e-7 * want.abs() + 1e-30).all()


def test_a_rows_bits_do_not_depend_on_its_batch_mates_or_the_threads():
    g = _gen(7)
    x, residual, weight = torch.randn(64, 576, generator=g), torch.randn(64, 576, generator=g), torch.randn(576)
    gate_up = torch.randn(64, 3072, generator=g)
    batch_norm = fused_cpu.add_rms_norm(x, residual, weight, 1e-5)[0]
    batch_silu = fused_cpu.silu_mul(gate_up)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for row in (0, 17, 63):
            alone = fused_cpu.add_rms_norm(x[row:row + 1], residual[row:row + 1], weight, 1e-5)[0]
            assert torch.equal(alone[0], batch_norm[row])
            assert torch.equal(fused_cpu.silu_mul(gate_up[row:row + 1])[0], batch_silu[row])
    finally:
        torch.set_num_threads(threads)


def test_what_the_kernel_does_not_take_runs_the_reference():
    x, weight = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(fused_cpu.add_rms_norm(x, None, weight, 1e-6)[0], fused_add_rms_norm_ref(x, None, weight, 1e-6)[0])
    gate_up = torch.randn(5, 64, dtype=torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fused_cpu.silu_mul(gate_up), F.silu(gate) * up)


def test_off_runs_torchs_ops_and_says_why(monkeypatch):
    monkeypatch.setenv("TANDEM_FUSED_OPS_KERNEL", "off")
    kernel = fused_cpu.CpuKernel(fused_cpu.SOURCE, [], "tandem_fused::add_rms_norm", fused_cpu._fake,
                                 "TANDEM_FUSED_OPS_KERNEL", (), module={}, fallback="reference",
                                 say=lambda *a: None, message="%s")
    assert not kernel.load()
    assert kernel.identity == "reference: TANDEM_FUSED_OPS_KERNEL=off"
    monkeypatch.setattr(fused_cpu._KERNEL, "loaded", False)  # what a process started with it off has
    x, weight = torch.randn(4, 64), torch.randn(64)
    assert torch.equal(fused_cpu.add_rms_norm(x, x, weight, 1e-5)[0], fused_add_rms_norm_ref(x, x, weight, 1e-5)[0])
    gate_up = torch.randn(4, 64)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fused_cpu.silu_mul(gate_up), F.silu(gate) * up)
