"""TritonAttentionBackend against TorchAttentionBackend on mixed decode + prefill steps, and a
whole model run through each."""

import random

import pytest
import torch

from kernel_cases import REL_TOL, attention_oracle, make_paged_kv, max_rel_err, query_start_loc, tiny_model
from shared.kvcache.layout import KvCacheSpec
from shared.model.attention import AttentionMetadata, TorchAttentionBackend, get_attention_backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_agree_on_mixed_batch(device, dtype):
    # two decodes, then a whole prompt, a chunk over a cached prefix and a one-token chunk
    q_lens = [1, 1, 20, 9, 1]
    seq_lens = [33, 16, 20, 41, 5]
    block_size, num_kv_heads, group, head_dim = 16, 2, 3, 64
    pool, k_cache, v_cache, table = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device)
    num_tokens = sum(q_lens)
    # the step's new K/V: written by the backend before attending, at each sequence's last q_len slots
    slots = []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(table[i, pos // block_size]) * block_size + pos % block_size)
    meta = AttentionMetadata(
        num_decodes=2,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc(q_lens, device),
        max_seq_len=max(seq_lens),
        max_query_len=max(q_lens),
    )
    # q, key, value as the model makes them: strided views of one fused projection
    num_q_heads = num_kv_heads * group
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim).to(dtype=dtype, device=device)
    q, key, value = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)

    triton_backend = get_attention_backend("triton", torch.device(device))
    torch_backend = TorchAttentionBackend()
    assert triton_backend.name == "triton"
    torch_pool = pool.clone()
    triton_backend.write_kv(key, value, k_cache, v_cache, meta)
    torch_backend.write_kv(key, value, torch_pool[:, 1, 0], torch_pool[:, 1, 1], meta)
    assert torch.equal(pool.nan_to_num(7.0), torch_pool.nan_to_num(7.0))

    out = triton_backend.attend(q, k_cache, v_cache, meta, head_dim ** -0.5)
    expected = torch_backend.attend(q, torch_pool[:, 1, 0], torch_pool[:, 1, 1], meta, head_dim ** -0.5)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert torch.isfinite(out).all()
    assert max_rel_err(out, expected) < 2 * REL_TOL[dtype]


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches_match_oracle(device, seed):
    """Random draws over the grid's axes and ragged lengths: decodes and prefill chunks together."""
    rng = random.Random(seed)
    block_size = rng.choice([16, 32, 128])
    head_dim = rng.choice([64, 128])
    group = rng.choice([1, 3, 8])
    num_kv_heads = rng.choice([1, 2])
    dtype = rng.choice([torch.float32, torch.bfloat16])
    num_decodes, num_prefills = rng.randint(0, 3), rng.randint(1 if seed % 2 else 0, 2)
    num_decodes = max(num_decodes, 1 - num_prefills)  # never an empty step
    seq_lens = [rng.randint(1, 300) for _ in range(num_decodes + num_prefills)]
    q_lens = [1] * num_decodes + [rng.choice([n, rng.randint(1, n)]) for n in seq_lens[num_decodes:]]
    pool, k_cache, v_cache, table = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, device,
                                                  seed=seed)
    meta = AttentionMetadata(
        num_decodes=num_decodes, slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        block_tables=table, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc(q_lens, device), max_seq_len=max(seq_lens), max_query_len=max(q_lens))
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim).to(dtype=dtype, device=device)
    scale = head_dim ** -0.5

    out = get_attention_backend("triton", torch.device(device)).attend(q, k_cache, v_cache, meta, scale)
    expected = TorchAttentionBackend().attend(q, k_cache, v_cache, meta, scale)
    oracle = attention_oracle(q, k_cache, v_cache, table, q_lens, seq_lens, scale)
    assert max_rel_err(out, oracle) < REL_TOL[dtype]
    assert max_rel_err(out, expected) < 2 * REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_forward_agrees_across_backends(device, dtype):
    """The model's norms, rotary, KV writes and attention all go through the backend: a prefill of
    two prompts, then a decode step of both, on each backend with its own pool."""
    assert_forward_agrees_across_backends(tiny_model(dtype, device), device, dtype)


# OLMo 2's layer (no pre-norms, post-norms, q/k norms over all heads) and a Gemma-like one (pre- and
# post-norms, gelu, scale and soft-cap, per-head q/k norms, a local rope on layer 0, scaled embeddings)
FAMILY_LAYERS = {
    "olmo2": dict(qk_norm="whole", pre_norms=False, post_norms=True),
    "gemma": dict(qk_norm="head", post_norms=True, activation="gelu_tanh", embedding_multiplier=8.0,
                  attention_scale=0.2, attn_softcap=2.0, local_layers=(0,), local_rope_theta=100.0),
}


@pytest.mark.parametrize("family", FAMILY_LAYERS)
def test_other_families_forward_agrees_across_backends(device, family):
    """The post-norms' residual-less norm through the Triton norm kernel, rotary of normed q/k,
    Gemma's soft-capped attention (torch on every backend) beside the Triton KV write."""
    assert_forward_agrees_across_backends(tiny_model(torch.float32, device, **FAMILY_LAYERS[family]), device,
                                          torch.float32)


def assert_forward_agrees_across_backends(model, device, dtype):
    block_size, prompt_lens = 8, [13, 21]
    spec = KvCacheSpec(2, 2, 16, block_size, dtype)
    tables = torch.tensor([[0, 1, 2, 0], [3, 4, 5, 6]], dtype=torch.int32, device=device)

    def step(q_lens, seq_lens, num_decodes):
        slots = [int(tables[i, p // block_size]) * block_size + p % block_size
                 for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)) for p in range(seq_len - q_len, seq_len)]
        positions = [p for q_len, seq_len in zip(q_lens, seq_lens) for p in range(seq_len - q_len, seq_len)]
        meta = AttentionMetadata(
            num_decodes=num_decodes, slot_mapping=torch.tensor(slots, device=device), block_tables=tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=query_start_loc(q_lens, device), max_seq_len=max(seq_lens), max_query_len=max(q_lens))
        ids = torch.tensor([(7 * p + 3 * i) % 97 for i, p in enumerate(positions)], device=device)
        return ids, torch.tensor(positions, device=device), meta

    outputs = []
    for backend in (TorchAttentionBackend(), get_attention_backend("triton", torch.device(device))):
        pool = spec.allocate(7, device)
        ids, pos, meta = step(prompt_lens, prompt_lens, 0)
        prefill = model.forward(ids, pos, pool, meta, backend)  # [34, hidden]
        ids, pos, meta = step([1, 1], [n + 1 for n in prompt_lens], 2)
        outputs.append((prefill, model.forward(ids, pos, pool, meta, backend)))  # [2, hidden]
    for got, expected in zip(outputs[1], outputs[0]):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        assert max_rel_err(got, expected) < 4 * REL_TOL[dtype]
