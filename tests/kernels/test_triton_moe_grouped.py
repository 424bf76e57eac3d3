"""The grouped linear layer of a mixture of experts (kernels/moe_grouped_triton.py) against its
torch reference, and MoeBlock (shared/model/moe.py) through the kernel against its loop over the
experts. Under the interpreter both compute bit for bit alike here; the tolerances leave the GPU
its own summation order (float32) and one rounding step apart (bfloat16, float16)."""

import pytest
import torch
import torch.nn.functional as F

from kernels.moe_grouped import grouped_linear_ref
from kernels.moe_grouped_triton import grouped_linear_triton, tile_config
from shared.model.config import Moe
from shared.model.moe import MoeBlock

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# rows per expert: empty experts first, last and between; one row; 37 rows (three 16-row tiles,
# the last partial); 150 rows over 2 experts (64-row tiles)
COUNTS = [[0, 1, 37, 0, 5, 1, 16, 0], [3], [150, 0], [0, 0, 7]]


def _counts_case(counts: list[int], dtype, device, seed: int = 0):
    """(x, weight, counts, rows): x holds 4 rows no pair reads, NaN, so a wrong gather shows."""
    gen = torch.Generator().manual_seed(seed)
    num_rows, num_tokens, n, k = sum(counts), max(sum(counts) // 2, 1), 136, 80  # N, K: masked tails
    x = torch.randn(num_tokens + 4, k, generator=gen)
    x[num_tokens:] = float("nan")
    weight = torch.randn(len(counts), n, k, generator=gen) / k ** 0.5
    rows = torch.randint(0, num_tokens, (num_rows,), generator=gen)
    return (x.to(dtype=dtype, device=device), weight.to(dtype=dtype, device=device),
            torch.tensor(counts, dtype=torch.int32, device=device), rows.to(device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", COUNTS)
def test_grouped_linear_gathers_rows_as_the_reference(device, dtype, counts):
    x, weight, counts_t, rows = _counts_case(counts, dtype, device)
    out = grouped_linear_triton(x, weight, counts_t, rows=rows)
    want = grouped_linear_ref(x, weight, counts_t, rows=rows)
    assert out.shape == (sum(counts), 136) and out.dtype == dtype
    torch.testing.assert_close(out, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_dtype", ["float32", "same"])  # Mixtral's weights; Qwen3-MoE's, rounded
def test_grouped_linear_scales_rows_as_the_reference(device, dtype, scale_dtype):
    counts = COUNTS[0]
    x, weight, counts_t, _ = _counts_case(counts, dtype, device, seed=1)
    x = torch.randn(sum(counts), x.shape[1]).to(dtype=dtype, device=device)  # no gather: rows in order
    scale = torch.rand(sum(counts)).to(dtype=torch.float32 if scale_dtype == "float32" else dtype, device=device)
    out = grouped_linear_triton(x, weight, counts_t, scale=scale)
    want = grouped_linear_ref(x, weight, counts_t, scale=scale)
    assert out.dtype == want.dtype == torch.promote_types(dtype, scale.dtype)
    torch.testing.assert_close(out, want, **TOL[dtype])


def test_the_cases_cover_every_tile_height():
    assert {tile_config(sum(c), len(c))["BLOCK_M"] for c in COUNTS} == {16, 64}
    assert tile_config(60, 2)["BLOCK_M"] == 32


def _block(dtype, device, round_weights: bool, kernel: str, num_experts: int = 8, hidden: int = 32,
           width: int = 48) -> MoeBlock:
    """A Mixtral-like block (top 2 of 8 SwiGLU experts, renormalised); expert 7 is never chosen
    for the inputs of ``_tokens`` (its router row is -100 on their constant feature 0)."""
    gen = torch.Generator().manual_seed(0)
    moe = Moe(num_experts=num_experts, top_k=2, intermediate_size=width, renormalize=True,
              round_weights=round_weights, layers=(0,))
    router = torch.randn(num_experts, hidden, generator=gen)
    router[:, 0] = 0.0
    router[7, 0] = -100.0
    weights = [router, torch.randn(num_experts, 2 * width, hidden, generator=gen) / hidden ** 0.5,
               torch.randn(num_experts, hidden, width, generator=gen) / width ** 0.5]
    return MoeBlock(moe, *(w.to(dtype=dtype, device=device) for w in weights), F.silu, kernel=kernel)


def _tokens(num_tokens: int, dtype, device, hidden: int = 32) -> torch.Tensor:
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1))
    x[:, 0] = 1.0
    return x.to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype,round_weights", [
    (torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False)])
def test_moe_block_through_the_kernel_is_its_loop_over_experts(device, dtype, round_weights):
    grouped, loop = (_block(dtype, device, round_weights, kernel) for kernel in ("triton", "torch"))
    x = _tokens(19, dtype, device)  # 38 pairs: not a multiple of any tile
    experts, _ = loop.route(x)
    assert 7 not in experts.tolist() and len(experts.unique()) == 7
    out = grouped.forward(x)
    torch.testing.assert_close(out, loop.forward(x), **TOL[dtype])
    assert out.dtype == dtype
    assert grouped.expert_tokens.tolist() == loop.expert_tokens.tolist()


def test_the_kernel_choice():
    """"auto" runs the loop on the CPU (and the kernel on CUDA where triton is installed)."""
    cpu = torch.device("cpu")
    assert _block(torch.float32, cpu, False, "auto").grouped_linear(_tokens(2, torch.float32, cpu)) is None
    assert _block(torch.float32, cpu, False, "torch").grouped_linear(_tokens(2, torch.float32, cpu)) is None
    assert _block(torch.float32, cpu, False, "triton").grouped_linear(_tokens(2, torch.float32, cpu)) \
        is grouped_linear_triton


def test_a_cuda_graph_captures_the_kernel(device):
    """The kernel's grid does not depend on the counts: a graph captured over one routing replays
    another's. Needs a GPU (TRITON_INTERPRET=0)."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    moe = _block(torch.bfloat16, device, False, "auto")
    static_x = _tokens(8, torch.bfloat16, device)
    moe.forward(static_x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe.forward(static_x)
    counted = moe.expert_tokens.clone()
    static_x.copy_(_tokens(8, torch.bfloat16, device).flip(0) * 2)
    graph.replay()
    torch.testing.assert_close(static_out, _block(torch.bfloat16, device, False, "torch").forward(static_x),
                               **TOL[torch.bfloat16])
    assert moe.expert_tokens.tolist() == counted.tolist()  # a capture and its replays are not counted
