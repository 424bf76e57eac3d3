"""DeepSeek's multi-head latent attention (MLA: DeepSeek-V2 and V3) over the paged pool, which holds the latent.

Every head's keys and values are made from one latent per token: ``c`` [kv_lora_rank], the normalised
compressed kv, through kv_b_proj (W_UK [H, nope, C] for the keys' position-free part, W_UV [H, v, C] for the
values), and one rotated key ``k_pe`` [qk_rope_head_dim] that all heads share. The pool stores that latent
[c, k_pe] and nothing per head, split across its two planes: the K plane holds its first half and the V
plane its second (``ModelConfig.from_hf`` declares num_kv_heads 1 and head_dim latent_size / 2). So the pool
keeps its one layout [blocks, layers, 2, block_size, heads, head_dim] and every byte mover (transfer, tiers,
peer fetch, which copy whole blocks) moves MLA blocks unchanged; a layout of its own would have meant a
second path through each of them.

Bytes per token: layers x (kv_lora_rank + qk_rope_head_dim) x itemsize, against layers x heads x
(qk_head_dim + v_head_dim) x itemsize for the same model's per-head K/V. DeepSeek-V3 (128 heads, latent
512 + 64, qk 192, v 128): 576 values a layer against 40960, 1/71; the tiny test model (4 heads, latent
32 + 8, qk 24, v 16): 40 against 160, 1/4.

Attention absorbs kv_b_proj into the query and the output (DeepSeek-V2's "absorb" form), so the per-head
keys and values are never made:

    scores[t, h, s] = (q_nope[t, h] @ W_UK[h]) . c[s] + q_pe[t, h] . k_pe[s]    (= k_nope . q_nope + q_pe . k_pe)
    out[t, h] = (softmax(scores)[t, h] @ c) @ W_UV[h]^T

which is multi-query attention over the latent: one KV head, keys [c, k_pe], values c. No attention kernel
takes keys and values of different widths, so on every backend it runs in torch over the latent gathered
from the pool (``gathered_attention(..., latent_values=kv_lora_rank)``), causal and by the step's block
tables like any layer's: prefix hits, chunked prefill and decode rows alike.

Under tensor parallelism (shared/model/parallel.py) a rank holds H / tp query heads: their rows of q_proj
(or q_b_proj) and of kv_b_proj (their W_UK and W_UV), and o_proj's columns of their values, whose partial
products the layer's all-reduce sums as any family's. The latent is the layer's one KV head and, as a KV
head is where there are fewer than the ranks, it is replicated: kv_a_proj_with_mqa and its norm (and q's
q_a_proj and norm) are whole on every rank, each computes the same latent and caches it in its own pool.
The memory cost: a rank's pool takes TP=1's bytes per token, not 1/tp of them as split KV heads would, and
a group holds tp copies of each latent (tp x the KV memory of one process for the same tokens). DeepSeek-V3
at tp 8 still keeps 61 x 576 values a token per rank against the 61 x 16 heads x 320 of per-head K/V split
8 ways (1/8.9).
"""

from __future__ import annotations

import torch

from kernels.rms_norm import fused_add_rms_norm_ref
from shared.model.attention import gathered_attention
from shared.model.config import ModelConfig
from shared.model.llama import LlamaLayer
from shared.model.parallel import Collectives, TensorSplit
from shared.model.quant import linear


def deinterleave_rows(weight: torch.Tensor, rows: int, start: int, rope: int) -> torch.Tensor:
    """``weight`` [groups * rows, in] with each group's rope outputs (rows start .. start + rope) reordered
    from DeepSeek's interleaved pairs (x0, x1), (x2, x3), ... to rotate-half's (x0, x2, ..., x1, x3, ...).
    transformers' ``apply_rotary_pos_emb_interleave`` rotates the pairs and writes the result in the
    rotate-half order; rotate-half rotary over the reordered projections gives the same numbers, for q and
    k alike, so the pool holds k_pe exactly as transformers' cache does."""
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]) + start
    index = torch.arange(rows)
    index[start:start + rope] = order
    grouped = weight.view(-1, rows, weight.shape[-1])
    return grouped[:, index.to(weight.device)].reshape(weight.shape)


class MlaLayer(LlamaLayer):
    """A DeepSeek decoder layer: ``LlamaLayer``'s norms, residual stream and MLP (dense, or DeepSeek-V3's
    experts: shared/model/moe.py's ``GroupLimitedMoeBlock``) around latent attention (this module's
    docstring). q through q_a_proj, its RMSNorm and q_b_proj (one q_proj where ``q_lora_rank`` is None); the
    latent through kv_a_proj_with_mqa, then RMSNorm over its compressed part; rotary on the rope channels
    only. On a tensor-parallel rank, its query heads and the whole latent (this module's docstring).

    Quantized (int8, gguf), its projections into q and into the latent, o_proj and the MLP or experts take
    the method's weights as any family's; kv_b_proj's halves W_UK and W_UV stay in the model's dtype: they
    are not products of a token's hidden state but the factors absorbed into the query and the output."""

    linear_names = ("q", "q_a", "q_b", "kv_a", "o_proj", "gate_up", "down")

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], split: TensorSplit,
                 group: Collectives, index: int = 0):
        super().__init__(cfg, {"qkv": None, **weights}, split, group, index)
        mla = self.mla = cfg.mla
        heads, qk, rope = split.num_heads, mla.qk_head_dim, mla.qk_rope_head_dim

        def rope_order(w: torch.Tensor, rows: int) -> torch.Tensor:
            return deinterleave_rows(w, rows, rows - rope, rope) if mla.rope_interleave else w

        self.q = None if weights.get("q") is None else rope_order(weights["q"], qk)  # [H * qk, hidden]
        self.q_a = weights.get("q_a")  # [q_lora_rank, hidden]
        self.q_a_norm = weights.get("q_a_norm")  # [q_lora_rank]
        self.q_b = None if weights.get("q_b") is None else rope_order(weights["q_b"], qk)  # [H * qk, q_lora_rank]
        self.kv_a = rope_order(weights["kv_a"], mla.latent_size)  # [kv_lora_rank + rope, hidden]
        self.kv_a_norm = weights["kv_a_norm"]  # [kv_lora_rank]
        kv_b = weights["kv_b"].view(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        self.w_uk = kv_b[:, :mla.qk_nope_head_dim]  # [H, nope, C]: q_nope into the latent's space
        self.w_uv = kv_b[:, mla.qk_nope_head_dim:]  # [H, v, C]: the latent's attention output to each head's value

    def forward(self, kv_views, hidden, residual, cos, sin, meta, backend):
        norm = backend.fused_add_rms_norm
        x, residual = self.norm_in(norm, hidden, residual, self.attn_norm)
        q, latent = self.project_latent(x, cos, sin, backend.rotary_embedding)
        k_cache, v_cache = kv_views
        half = latent.shape[-1] // 2  # the K plane holds the latent's first half, the V plane its second
        backend.write_kv(latent[:, None, :half].contiguous(), latent[:, None, half:].contiguous(), k_cache, v_cache,
                         meta)
        ctx = gathered_attention(q, k_cache, v_cache, meta, self.scale, latent_values=self.mla.kv_lora_rank)
        out = torch.einsum("thc,hvc->thv", ctx, self.w_uv).reshape(-1, self.num_heads * self.mla.v_head_dim)
        hidden = self.norm_out(norm, self.group.all_reduce(linear(out, self.o_proj)), self.attn_out_norm)
        x, residual = self.norm_in(norm, hidden, residual, self.mlp_norm)
        return self.norm_out(norm, self.group.all_reduce(self.mlp(x)), self.mlp_out_norm), residual

    def project_latent(self, x, cos, sin, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """(q in latent space [T, H, kv_lora_rank + rope]: q_nope @ W_UK, then q_pe rotated;
        the token's latent [T, kv_lora_rank + rope]: c normed, then k_pe rotated)."""
        mla, eps = self.mla, self.cfg.rms_norm_eps
        if self.q is not None:
            q = linear(x, self.q)
        else:
            q = linear(fused_add_rms_norm_ref(linear(x, self.q_a), None, self.q_a_norm, eps)[0], self.q_b)
        q_nope, q_pe = q.view(-1, self.num_heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        c, k_pe = linear(x, self.kv_a).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        c = fused_add_rms_norm_ref(c.contiguous(), None, self.kv_a_norm, eps)[0]
        q_pe, k_pe = rotary(q_pe.contiguous(), k_pe[:, None].contiguous(), cos, sin)
        q_latent = torch.einsum("thn,hnc->thc", q_nope, self.w_uk)
        return torch.cat([q_latent, q_pe], dim=-1), torch.cat([c, k_pe[:, 0]], dim=-1)
