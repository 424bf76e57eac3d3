"""The torch backend's attention gives every row the same bits whatever shares its step: a decode
row alone or in a ragged batch, a prompt prefilled whole or in chunks cut anywhere (the references,
and the CPU kernel that replaces both where it builds). (With int8
linear layers everything else in a step is row-wise exact, so this is what keeps a request's greedy
text independent of its batch-mates: ``tests/engine/test_quantization_smollm2.py``.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.decode_attention import paged_decode_attention_ref
from kernels import prefill_attention
from kernels.prefill_attention import QUERY_TILE, paged_prefill_attention_ref

BS, HKV, HQ, D = 16, 3, 9, 64  # SmolLM2-135M's heads


def paged_cache(lens: list[int], seed: int = 0):
    """Random K/V for sequences of ``lens`` tokens in shuffled blocks, NaN in every unused slot."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // BS) for n in lens]
    num_blocks = sum(per_seq) + 1
    order = torch.randperm(num_blocks, generator=g)
    k = torch.full((num_blocks, BS, HKV, D), float("nan"))
    v = torch.full((num_blocks, BS, HKV, D), float("nan"))
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    at = 0
    for i, (n, nb) in enumerate(zip(lens, per_seq)):
        tables[i, :nb] = order[at:at + nb]
        at += nb
        for pos in range(n):
            b, off = int(tables[i, pos // BS]), pos % BS
            k[b, off] = torch.randn(HKV, D, generator=g)
            v[b, off] = torch.randn(HKV, D, generator=g)
    return k, v, tables


@pytest.mark.parametrize("lens", [[16, 16, 16], [5, 16, 17, 100, 143], [300, 513, 530, 1100, 7]])
def test_a_decode_row_is_the_same_alone_and_in_any_batch(lens):
    k, v, tables = paged_cache(lens)
    q = torch.randn(len(lens), HQ, D, generator=torch.Generator().manual_seed(1))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    together = paged_decode_attention_ref(q, k, v, tables, seq_lens, D ** -0.5)
    assert not together.isnan().any()
    for i in range(len(lens)):
        alone = paged_decode_attention_ref(q[i:i + 1], k, v, tables[i:i + 1], seq_lens[i:i + 1], D ** -0.5)
        assert torch.equal(alone[0], together[i]), f"sequence {i} of {lens}"
    pair = paged_decode_attention_ref(q[:2], k, v, tables[:2], seq_lens[:2], D ** -0.5)
    assert torch.equal(pair, together[:2])


def kernel_attention(*args):
    """The C++ CPU kernel (``kernels/cpu/prefill_attention.cpp``), skipping where it cannot run."""
    if not prefill_attention.usable(args[0], args[1]):
        pytest.skip(f"no CPU prefill attention kernel here: {prefill_attention.identity()}")
    return prefill_attention.paged_prefill_attention(*args)


PREFILLS = {"reference": paged_prefill_attention_ref, "kernel": kernel_attention}


@pytest.mark.parametrize("lens", [[16, 16, 16], [5, 16, 17, 100, 143], [300, 513, 530, 1100, 7]])
def test_the_kernels_decode_rows_are_the_same_alone_in_any_batch_and_prefilled(lens):
    """The CPU kernel takes decode rows as sequences of one query (the torch backend sends it every
    row): a row alone, in a batch, or as the last query of its whole prompt prefilled gets the same bits."""
    k, v, tables = paged_cache(lens)
    q = torch.randn(len(lens), HQ, D, generator=torch.Generator().manual_seed(1))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    loc = torch.arange(len(lens) + 1, dtype=torch.int32)
    together = kernel_attention(q, k, v, tables, loc, seq_lens, D ** -0.5)
    assert not together.isnan().any()
    for i in range(len(lens)):
        alone = kernel_attention(q[i:i + 1], k, v, tables[i:i + 1], loc[:2], seq_lens[i:i + 1], D ** -0.5)
        assert torch.equal(alone[0], together[i]), f"sequence {i} of {lens}"
        g = torch.Generator().manual_seed(i)
        prompt = torch.cat([torch.randn(lens[i] - 1, HQ, D, generator=g), q[i:i + 1]])
        whole = kernel_attention(prompt, k, v, tables[i:i + 1], torch.tensor([0, lens[i]], dtype=torch.int32),
                                 seq_lens[i:i + 1], D ** -0.5)
        assert torch.equal(whole[-1], together[i]), f"sequence {i} of {lens}, prefilled"
    torch.testing.assert_close(together, paged_decode_attention_ref(q, k, v, tables, seq_lens, D ** -0.5),
                               rtol=1e-5, atol=1e-5)


def prefill(q, k, v, tables, lens, chunks, attention=paged_prefill_attention_ref):
    """Prefill one sequence (row 0 of ``tables``) in chunks of the given sizes, batched beside a
    second sequence's whole prompt (row 1) in every call; returns the first sequence's rows."""
    out, done = [], 0
    for size in chunks:
        first_len, other = done + size, lens[1]
        rows = torch.cat([q[0][done:done + size], q[1][:other]])
        loc = torch.tensor([0, size, size + other], dtype=torch.int32)
        seq_lens = torch.tensor([first_len, other], dtype=torch.int32)
        out.append(attention(rows, k, v, tables, loc, seq_lens, D ** -0.5)[:size])
        done += size
    return torch.cat(out)


@pytest.mark.parametrize("attention", PREFILLS)
@pytest.mark.parametrize("length", [37, QUERY_TILE + 3, 700])
def test_a_prompt_prefilled_in_any_chunks_gets_the_same_bits(length, attention):
    lens = [length, 50]
    k, v, tables = paged_cache(lens, seed=2)
    g = torch.Generator().manual_seed(3)
    q = [torch.randn(n, HQ, D, generator=g) for n in lens]
    whole = prefill(q, k, v, tables, lens, [length], PREFILLS[attention])
    assert not whole.isnan().any()
    for cuts in ([1], [length - 1], [31, 64], list(range(64, length, 64)), [QUERY_TILE - 1, QUERY_TILE + 1]):
        bounds = [0] + [c for c in cuts if 0 < c < length] + [length]
        chunks = [b - a for a, b in zip(bounds, bounds[1:])]
        assert torch.equal(prefill(q, k, v, tables, lens, chunks, PREFILLS[attention]), whole), chunks
    # and the result is causal attention over the prompt
    kk = k[tables[0, :-(-length // BS)].long()].reshape(-1, HKV, D)[:length].transpose(0, 1)
    vv = v[tables[0, :-(-length // BS)].long()].reshape(-1, HKV, D)[:length].transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[0].transpose(0, 1)[None], kk[None], vv[None], is_causal=True, scale=D ** -0.5, enable_gqa=True)
    torch.testing.assert_close(whole, ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


NOT_INTEL = "int mkl_serv_intel_cpu_true(void) { return 0; }\n"


@pytest.mark.skipif(os.environ.get("TANDEM_MKL_SHIM") is not None, reason="already under the shim")
def test_the_rows_stay_the_same_when_mkl_takes_another_vendors_code_paths(tmp_path):
    """MKL picks its kernels by CPU vendor; off Intel CPUs (AMD Zen 4 measured) its sgemm results
    depend on the alignment of the buffers torch's attention hands it, which differ per thread, so
    a decode row alone and in a batch differed in its last bits. A preloaded shim that answers MKL's
    vendor check with "not Intel" puts those code paths on this machine: without ``MKL_CBWR`` (set
    empty) the checks above must fail there, or the shim does not bite and there is nothing to
    check; with the default that ``kernels`` sets, they must pass."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not torch.backends.mkl.is_available():
        pytest.skip("needs a C compiler and torch built with MKL")
    (tmp_path / "shim.c").write_text(NOT_INTEL)
    shim = tmp_path / "libnotintel.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "shim.c")], check=True)

    def run(extra_env: dict[str, str]) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
        env.update(LD_PRELOAD=str(shim), TANDEM_MKL_SHIM="1", **extra_env)
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "decode_row or prefilled",
             str(Path(__file__))], env=env, capture_output=True, text=True, timeout=300)

    unpinned = run({"MKL_CBWR": ""})
    if unpinned.returncode == 0:
        pytest.skip("MKL's non-Intel code paths give the same bits here too: nothing to compare")
    assert "sequence" in unpinned.stdout, unpinned.stdout[-2000:]  # it failed on bits, not on a crash
    pinned = run({})
    assert pinned.returncode == 0, pinned.stdout[-3000:] + pinned.stderr[-2000:]
