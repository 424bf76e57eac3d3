"""The torch backend's per-step plans: decode attention and the KV write derive their indices once
per step (``AttentionMetadata.derived``) and every layer reuses them; the results are those of a
plain per-sequence attention, with or without padding, whatever the unused cache slots hold."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import decode_plan, paged_decode_attention_ref
from kernels.rotary import _rotate, rotary_embedding_ref
from kernels import prefill_attention
from shared.model.attention import AttentionMetadata, TorchAttentionBackend

NUM_BLOCKS, BS, HKV, HQ, D = 64, 16, 2, 6, 32


def naive(q, k_cache, v_cache, tables, lens, scale):
    out = []
    for i, n in enumerate(lens):
        k = k_cache[tables[i].long()].reshape(-1, HKV, D)[:n].repeat_interleave(HQ // HKV, 1)
        v = v_cache[tables[i].long()].reshape(-1, HKV, D)[:n].repeat_interleave(HQ // HKV, 1)
        p = (torch.einsum("hd,lhd->hl", q[i], k) * scale).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(out)


def caches(lens, tables):
    """Random K/V where the sequences' tokens live, NaN in every slot past them."""
    k, v = torch.full((2, NUM_BLOCKS, BS, HKV, D), float("nan")).unbind(0)
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate(lens):
        for pos in range(n):
            b, off = int(tables[i, pos // BS]), pos % BS
            k[b, off] = torch.randn(HKV, D, generator=g)
            v[b, off] = torch.randn(HKV, D, generator=g)
    return k, v


@pytest.mark.parametrize("lens", [[37], [40, 40, 40], [5, 70, 33], [16, 32]])
def test_planned_decode_attention_matches_per_sequence_attention(lens):
    tables = torch.randperm(NUM_BLOCKS)[:len(lens) * 5].view(len(lens), 5).int()
    k_cache, v_cache = caches(lens, tables)
    q = torch.randn(len(lens), HQ, D)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    plan = decode_plan(tables, seq_lens, BS)
    assert plan.valid.sum(1).tolist() == lens  # masked past each length, equal lengths too
    got = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.2)
    assert not got.isnan().any()
    torch.testing.assert_close(got, naive(q, k_cache, v_cache, tables, lens, 0.2), rtol=1e-5, atol=1e-5)


def test_backend_makes_each_plan_once_per_step(monkeypatch):
    """The references' plans (where the CPU kernel runs, it takes every row and needs none: below)."""
    monkeypatch.setattr(prefill_attention, "usable", lambda q, k_cache: False)
    lens = [9, 20]
    tables = torch.tensor([[3, 0], [5, 6]], dtype=torch.int32)
    slots = torch.tensor([3 * BS + 8, 6 * BS + 3])
    meta = AttentionMetadata(num_decodes=2, slot_mapping=slots, block_tables=tables,
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
                             max_seq_len=20, max_query_len=1)
    backend = TorchAttentionBackend()
    k_cache, v_cache = caches(lens, tables)
    key, value = torch.randn(2, 2, HKV, D).unbind(0)
    backend.write_kv(key, value, k_cache, v_cache, meta)
    assert torch.equal(k_cache[3, 8], key[0]) and torch.equal(v_cache[6, 3], value[1])
    plan = meta.derived["kv_write"]
    q = torch.randn(2, HQ, D)
    first = backend.attend(q, k_cache, v_cache, meta, 0.2)
    decode = meta.derived["decode"]
    second = backend.attend(q, k_cache, v_cache, meta, 0.2)  # the next layer: same plan object
    backend.write_kv(key, value, k_cache, v_cache, meta)
    assert meta.derived["decode"] is decode and meta.derived["kv_write"] is plan
    assert torch.equal(first, second)
    torch.testing.assert_close(first, naive(q, k_cache, v_cache, tables, lens, 0.2), rtol=1e-5, atol=1e-5)


def test_the_cpu_kernel_takes_decode_and_prefill_rows_of_one_step():
    lens, q_lens = [9, 20, 33], [1, 1, 12]
    tables = torch.tensor([[3, 0, 0], [5, 6, 0], [7, 8, 9]], dtype=torch.int32)
    k_cache, v_cache = caches(lens, tables)
    meta = AttentionMetadata(num_decodes=2, slot_mapping=torch.zeros(14, dtype=torch.long), block_tables=tables,
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 1, 2, 14], dtype=torch.int32), max_seq_len=33,
                             max_query_len=12)
    q = torch.randn(sum(q_lens), HQ, D)
    if not prefill_attention.usable(q, k_cache):
        pytest.skip(f"no CPU attention kernel here: {prefill_attention.identity()}")
    got = TorchAttentionBackend().attend(q, k_cache, v_cache, meta, 0.2)
    assert "decode" not in meta.derived  # no plan: the kernel reads the pool per row
    torch.testing.assert_close(got[:2], naive(q[:2], k_cache, v_cache, tables[:2], lens[:2], 0.2), rtol=1e-5,
                               atol=1e-5)
    prompt = [naive(q[2 + j:3 + j], k_cache, v_cache, tables[2:], [lens[2] - 11 + j], 0.2) for j in range(12)]
    torch.testing.assert_close(got[2:], torch.cat(prompt), rtol=1e-5, atol=1e-5)


def test_joint_rotary_equals_separate_rotations():
    t, half = 5, D // 2
    q, k = torch.randn(t, HQ, D), torch.randn(t, HKV, D)
    angles = torch.rand(t, half) * 6
    cos, sin = angles.cos(), angles.sin()
    rq, rk = rotary_embedding_ref(q, k, cos, sin)
    assert torch.equal(rq, _rotate(q, cos, sin)) and torch.equal(rk, _rotate(k, cos, sin))
    assert rq.shape == q.shape and rk.shape == k.shape
