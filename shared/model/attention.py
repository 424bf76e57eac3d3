"""The model's kernel seam: KV write, attention, the fused residual add + RMSNorm and rotary
embedding go through a backend; backends differ only in kernels (kernels/: the torch references
here, their Triton versions in kernels/backend.py).

Token order inside a step: the ``num_decodes`` decode rows come first (one token each: a
sequence's decode token, or one of a speculative step's tokens, each with its own context length),
then the prefill chunks. ``block_tables``, ``seq_lens`` and ``query_start_loc`` cover all sequences in
that order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kernels.decode_attention import decode_plan, paged_decode_attention_planned
from kernels.kv_write import kv_write_plan, write_kv_planned
from kernels import fused_cpu, prefill_attention
from kernels.prefill_attention import paged_prefill_attention_ref


@dataclass
class AttentionMetadata:
    num_decodes: int  # decode rows, first in the batch; one token each
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset per new token
    block_tables: torch.Tensor  # [B, M] int32
    seq_lens: torch.Tensor  # [B] int32: context length after this step's tokens
    query_start_loc: torch.Tensor  # [B + 1] int32: token offsets of each sequence
    max_seq_len: int
    max_query_len: int
    # [num_decodes] int64: the first position the step computes for each decode row's request, where
    # some row reads K/V the step itself computes (a speculative entry's draft rows, a row per token);
    # None: every decode row's context before its own token is in the cache already
    step_starts: torch.Tensor | None = None
    # what a backend derives from the fields above once per step and reuses in every layer
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def derive(self, key: str, make: Callable[[], Any]) -> Any:
        """``derived[key]``, made by ``make()`` the first time a layer of this step asks."""
        value = self.derived.get(key)
        if value is None:
            value = self.derived[key] = make()
        return value


def chunk_metadata(meta: AttentionMetadata, lo: int, hi: int, num_tokens: int) -> AttentionMetadata:
    """The metadata of tokens ``[lo, hi)`` of a step of one prefill sequence of ``num_tokens``
    tokens, run as a step of their own after tokens ``[0, lo)`` (a pipeline's chunk: the earlier
    ones' K/V are in the cache by then)."""
    assert meta.num_decodes == 0 and meta.seq_lens.shape[0] == 1, "one prefill sequence"
    seq_len = int(meta.seq_lens[0]) - num_tokens + hi
    return AttentionMetadata(
        num_decodes=0, slot_mapping=meta.slot_mapping[lo:hi], block_tables=meta.block_tables,
        seq_lens=torch.tensor([seq_len], dtype=meta.seq_lens.dtype, device=meta.seq_lens.device),
        query_start_loc=torch.tensor([0, hi - lo], dtype=meta.query_start_loc.dtype,
                                     device=meta.query_start_loc.device),
        max_seq_len=seq_len, max_query_len=hi - lo)


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store this step's K/V ([T, Hkv, D]) at ``meta.slot_mapping`` in one layer's cache views."""

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        scale: float, window: int | None = None,
    ) -> torch.Tensor:
        """Attention of q ([T, Hq, D]) over the cache, which already holds this step's K/V.
        Returns [T, Hq, D]; causal within each sequence. With a sliding ``window`` (the layer's:
        ``ModelConfig.layer_window``), the query at position p sees the keys in (p - window, p]."""

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of ``x + residual`` (``x`` alone when ``residual`` is None), x: [T, H].
        Returns (normed [T, H], the sum, which is the next residual)."""

    def rotary_embedding(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half rotary embedding of q ([T, Hq, D]) and k ([T, Hkv, D]) by per-token
        cos, sin ([T, D/2]). Returns the rotated (q, k); the inputs are left as they are."""


class TorchAttentionBackend:
    """Plain-torch reference kernels; the CPU path and the oracle for the Triton kernels."""

    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, meta):
        plan = meta.derive("kv_write", lambda: kv_write_plan(meta.slot_mapping, k_cache.shape[1]))
        write_kv_planned(key, value, k_cache, v_cache, plan)

    def attend(self, q, k_cache, v_cache, meta, scale, window=None):
        nd = meta.num_decodes
        if prefill_attention.usable(q, k_cache):  # every row, decode rows as one-query sequences: one
            return prefill_attention.kernel_attention(  # function of the row alone, prefilled or decoded
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, window=window)
        parts = []
        if nd:  # one plan per window in the step's layers (Gemma's windowed and global layers: two)
            plan = meta.derive("decode" if window is None else f"decode/window={window}", lambda: decode_plan(
                meta.block_tables[:nd], meta.seq_lens[:nd], k_cache.shape[1], window))
            parts.append(paged_decode_attention_planned(q[:nd], k_cache, v_cache, plan, scale))
        if q.shape[0] > nd:
            qsl = meta.query_start_loc[nd:] - nd
            parts.append(paged_prefill_attention_ref(
                q[nd:], k_cache, v_cache, meta.block_tables[nd:], qsl, meta.seq_lens[nd:], scale, window=window))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def fused_add_rms_norm(self, x, residual, weight, eps):  # on a CPU with AVX-512F: kernels/fused_cpu.py
        return fused_cpu.add_rms_norm(x, residual, weight, eps)

    def rotary_embedding(self, q, k, cos, sin):
        return fused_cpu.rotary(q, k, cos, sin)


def gathered_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, window: int | None = None, *, softcap: float | None = None,
                       sinks: torch.Tensor | None = None, latent_values: int | None = None) -> torch.Tensor:
    """``AttentionBackend.attend`` in torch over K/V gathered from the cache (any device, float32 sums),
    for the softmaxes no kernel computes: with ``softcap`` every score s becomes
    ``softcap * tanh(s / softcap)`` (Gemma 2); with ``sinks`` ([Hq], gpt-oss) head h's softmax has one more
    column, logit ``sinks[h]``, which takes its share of the probability and adds no value. With
    ``latent_values`` (DeepSeek's latent attention, shared/model/mla.py) a token's key is its K and V planes
    side by side [Hkv, 2D] and its value that key's first ``latent_values`` channels: q [T, Hq, 2D] ->
    [T, Hq, latent_values]. Decode rows at once over their whole block-table rows (no host sync, so a CUDA
    graph can hold it), prefill chunks one sequence at a time. [T, Hq, D] -> [T, Hq, D]."""
    nd, parts = meta.num_decodes, []
    block_size, kv_heads, head_dim = k_cache.shape[1:]

    def gather(table: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:  # [rows, L, Hkv, D or 2D]
        k = k_cache[table].reshape(rows, -1, kv_heads, head_dim)
        v = v_cache[table].reshape(rows, -1, kv_heads, head_dim)
        if latent_values is None:
            return k, v
        k = torch.cat([k, v], dim=-1)
        return k, k[..., :latent_values]

    if nd:
        tables = meta.block_tables[:nd].long()  # [nd, M]
        positions = torch.arange(tables.shape[1] * block_size, device=q.device)[None]
        valid = positions < meta.seq_lens[:nd, None]
        if window is not None:
            valid &= positions >= meta.seq_lens[:nd, None] - window
        k, v = gather(tables, nd)  # [nd, M * bs, Hkv, D]
        v = torch.where(valid[:, :, None, None], v, 0.0)
        parts.append(_attend(q[:nd, None], k, v, valid[:, None], scale, softcap, sinks)[:, 0])
    starts, lens = (meta.query_start_loc.tolist(), meta.seq_lens.tolist()) if q.shape[0] > nd else ([], [])
    for i in range(nd, len(lens)):
        q_start, q_end, seq_len = starts[i], starts[i + 1], lens[i]
        k, v = gather(meta.block_tables[i, :-(-seq_len // block_size)].long(), 1)
        k, v = k[:, :seq_len], v[:, :seq_len]  # [1, L, Hkv, D]
        q_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)
        keys = torch.arange(seq_len, device=q.device)[None, :]
        causal = keys <= q_pos[:, None]  # [Lq, L]
        if window is not None:
            causal &= keys > q_pos[:, None] - window
        parts.append(_attend(q[None, q_start:q_end], k, v, causal[None], scale, softcap, sinks)[0])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _attend(q, k, v, mask, scale: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, Lq, Hq, D]; k [B, L, Hkv, D], v [B, L, Hkv, Dv]; mask [B, Lq, L] true where a query sees a key;
    sinks [Hq]. Returns [B, Lq, Hq, Dv]."""
    b, lq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    qg = q.float().view(b, lq, kv_heads, heads // kv_heads, head_dim)  # head h = its KV head * group + j
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.float()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:  # the sink's column joins the softmax and is dropped after it
        sink = sinks.float().view(1, kv_heads, -1, 1, 1).expand(b, -1, -1, lq, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float())
    return out.reshape(b, lq, heads, v.shape[-1]).to(q.dtype)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks Triton on CUDA and the torch reference elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        try:
            from kernels.backend import TritonAttentionBackend
        except ImportError as exc:
            raise ValueError(f"attention backend 'triton' is not available: {exc}") from exc
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (choose auto, torch or triton)")
