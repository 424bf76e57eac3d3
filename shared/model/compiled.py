"""A CPU decode step as one compiled graph (``torch.compile``, inductor's C++ backend).

An eager decode step of SmolLM2-135M makes about 7,700 aten op calls: 30 layers of norms,
activation quantization, rotary, the KV write, the attention gather and SDPA, each one op through
torch's dispatcher from Python. At batch 1 on a CPU that dispatch costs about what the ops' work
does. ``CompiledDecode`` traces the whole forward of a decode-only step once, from the same
reference functions the eager model runs, so inductor fuses the small elementwise ops into a few
C++ loops and the step is one call.

Three things differ from the eager step, all so that the graph is the same at every step:

* the cache is only read inside the graph. Each layer attends over the cached past (the positions
  before the step's token, gathered by block table and masked past each sequence's length) plus the
  token's own K/V, which the graph returns; the runner writes all layers' new K/V into the cache
  with one indexed copy after the graph. Writing inside the graph would make inductor copy the
  whole pool;
* the past is always masked (the eager path cuts it instead when every length is equal), so the
  attention sums differ from eager in the last bits of float32;
* attention is written out as products and sums (``_decode_attention``), the step's own token
  joining the softmax beside the past rather than concatenated to it: inductor then reads the
  pool inside its reduction loops. SDPA's CPU kernel cost about 50 µs a layer at batch 1, and
  matmuls over a concatenated K/V made inductor copy and transpose the gathered past first
  (about 125 µs a layer).

The graph's caller is C++ (inductor's ``cpp_wrapper``), not generated Python, and dynamo checks only
the guards on the step's inputs, not on the ~300 weight tensors the graph reads (they never change
once the model is loaded). Measured on a 2-core AVX-512 CPU (SmolLM2-135M, int8 layers, batch 1):
eager 17.6 ms a step; compiled with a Python caller and SDPA 12.9 ms; with a C++ caller, input
guards and matmul attention 9.8 ms; this graph 8.4 ms.

Sizes are symbolic (``dynamic=True``): one graph serves every batch of two or more sequences and
every context length, and torch specializes one more for batch 1. ``warm()`` compiles both; a
worker does that on a thread of its own while eager steps serve (``shared/engine/compile_thread.py``),
or before it takes traffic. A cold compile takes minutes on a small CPU; inductor's on-disk cache
makes the next process's compile take seconds. Prefill, chunked and speculative steps stay eager.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from kernels.cast import cast
from kernels.rms_norm import fused_add_rms_norm_ref
from kernels.rotary import rotary_embedding_ref
from shared.model.attention import AttentionMetadata
from shared.model.quant import linear

log = logging.getLogger(__name__)


class CompiledDecode:
    on_recompile = "eager_on_recompile"  # torch.compiler stance for the steps after warm(); tests: fail_on_recompile

    def __init__(self, model, block_size: int, num_threads: int | None = None) -> None:
        if model.device.type != "cpu":
            raise ValueError(f"the compiled decode step runs on the CPU, not on {model.device.type}")
        self.model = model
        self.block_size = block_size
        self.num_steps = 0  # decode steps run through the graph
        self.cache_hits = self.cache_misses = 0  # warm()'s graphs from inductor's disk cache / compiled
        self.warm_s = 0.0  # how long warm() took
        # the C++ loops' OpenMP team size is fixed when they are generated: the engine thread's, not
        # that of the thread that happens to compile them
        threads = num_threads or torch.get_num_threads()
        self._graph = torch.compile(self._forward, dynamic=True, options={
            "cpp_wrapper": True, "cpp.threads": threads, "guard_filter_fn": _inputs_guards_only})

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                 past_blocks: torch.Tensor, past_valid: torch.Tensor):
        model, cfg = self.model, self.model.cfg
        num_seqs, past_len = past_valid.shape
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        hidden = F.embedding(input_ids, model.embed)
        cos, sin = model.rope_cos_sin(positions)
        mask = past_valid[:, :, None, None]  # [B, L, 1, 1]: the cached positions each sequence has
        residual = None
        new_k, new_v = [], []
        for i, layer in enumerate(model.layers):
            x, residual = fused_add_rms_norm_ref(hidden, residual, layer.attn_norm, cfg.rms_norm_eps)
            q, k, v = linear(x, layer.qkv, layer.qkv_bias).split([q_size, kv_size, kv_size], dim=-1)
            q, k = rotary_embedding_ref(q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), cos, sin)
            v = v.view(-1, kv_heads, head_dim)
            new_k.append(k)
            new_v.append(v)
            attn = _decode_attention(q, cast(k, kv_cache.dtype), cast(v, kv_cache.dtype),
                                     kv_cache[past_blocks, i, 0].view(num_seqs, past_len, kv_heads, head_dim),
                                     kv_cache[past_blocks, i, 1].view(num_seqs, past_len, kv_heads, head_dim), mask)
            hidden = linear(cast(attn, q.dtype).reshape(num_seqs, q_size), layer.o_proj)
            x, residual = fused_add_rms_norm_ref(hidden, residual, layer.mlp_norm, cfg.rms_norm_eps)
            gate, up = linear(x, layer.gate_up).chunk(2, dim=-1)
            hidden = linear(F.silu(gate) * up, layer.down)
        out = fused_add_rms_norm_ref(hidden, residual, model.norm, cfg.rms_norm_eps)[0]
        return out, torch.stack(new_k, dim=1), torch.stack(new_v, dim=1)  # [B, hidden], [B, layers, Hkv, D] x2

    @staticmethod
    def applies(meta: AttentionMetadata, num_tokens: int) -> bool:
        """A decode-only step: one new token per sequence, no prefill chunk, no draft rows."""
        return meta.num_decodes == num_tokens == meta.seq_lens.shape[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states [B, hidden] of a decode-only step; writes its K/V into ``kv_cache``."""
        bs = self.block_size
        past = meta.seq_lens.long() - 1
        # at least 2 blocks (the spare ones masked): with 1, the table's length would equal the batch
        # size, and the graph traced with the two apart would be compiled again for that case
        num_blocks = max(2, -(-(meta.max_seq_len - 1) // bs))
        table = meta.block_tables[:, :num_blocks].long()
        if table.shape[1] < num_blocks:
            table = F.pad(table, (0, num_blocks - table.shape[1]))
        starts = torch.arange(num_blocks, device=table.device) * bs
        table = torch.where(starts[None, :] < past[:, None], table, 0)  # blocks past a length: block 0, masked
        past_valid = torch.arange(num_blocks * bs, device=table.device)[None, :] < past[:, None]
        _mark_pool_static(kv_cache)
        # the inputs are made outside inference mode, here and in warm(): torch guards on it
        # a step whose shapes no compiled graph fits (none should, after warm()) runs the same function
        # eagerly rather than stopping the engine for a compile
        with torch.inference_mode(), torch.compiler.set_stance(self.on_recompile):
            hidden, new_k, new_v = self._graph(input_ids, positions, kv_cache, table.reshape(-1), past_valid)
        block = torch.div(meta.slot_mapping, bs, rounding_mode="floor")
        offset = meta.slot_mapping - block * bs
        kv_cache[block, :, 0, offset] = cast(new_k, kv_cache.dtype)
        kv_cache[block, :, 1, offset] = cast(new_v, kv_cache.dtype)
        self.num_steps += 1
        return hidden

    def warm(self, kv_cache: torch.Tensor) -> None:
        """Compile the graphs (batch 1, and one for every larger batch) before traffic comes: a
        step over block 0 whose results are dropped; nothing is written to the cache."""
        cfg = self.model.cfg
        dev = kv_cache.device
        started = time.perf_counter()
        before = inductor_cache_counts()
        _mark_pool_static(kv_cache)
        # sizes unlike each other and unlike the model's (torch gives equal sizes one symbol when it
        # traces, which would tie the batch to, say, the number of KV heads)
        num_blocks = 7
        for num_seqs in (1, 5):
            ids = torch.zeros(num_seqs, dtype=torch.long, device=dev)
            pos = torch.ones(num_seqs, dtype=torch.long, device=dev)
            blocks = torch.zeros(num_seqs * num_blocks, dtype=torch.long, device=dev)
            valid = torch.zeros(num_seqs, num_blocks * self.block_size, dtype=torch.bool, device=dev)
            valid[:, 0] = True
            with torch.inference_mode():
                self._graph(ids, pos, kv_cache, blocks, valid)
        hits, misses = (now - then for now, then in zip(inductor_cache_counts(), before))
        self.cache_hits, self.cache_misses = hits, misses
        self.warm_s = time.perf_counter() - started
        log.info("compiled the decode step of %d layers in %.1f s (graphs: %d from inductor's cache, %d compiled)",
                 cfg.num_layers, self.warm_s, hits, misses)


def inductor_cache_counts() -> tuple[int, int]:
    """Graphs this process found in inductor's FX graph cache, and graphs it had to compile, so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor,
                      past_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query per sequence over its cached past and its own new key/value, in float32.

    q [B, H, D]; k, v [B, Hkv, D] (the step's token); past_k, past_v [B, L, Hkv, D] gathered from the
    pool; mask [B, L, 1, 1] true where a past position exists. Written as products and sums, not as
    matmuls over a concatenated K/V: inductor then reads the pool inside its reduction loops instead
    of copying the gathered K/V out first. The new token's score joins the softmax separately.
    Returns [B, H, D]."""
    num_seqs, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    scale = head_dim ** -0.5
    qg = cast(q, torch.float32).view(num_seqs, 1, kv_heads, heads // kv_heads, head_dim)  # [B, 1, Hkv, G, D]
    past = (qg * cast(past_k, torch.float32)[:, :, :, None, :]).sum(-1) * scale  # [B, L, Hkv, G]
    past = torch.where(mask, past, float("-inf"))  # also drops whatever an unused slot holds (NaN included)
    own = (qg[:, 0] * cast(k, torch.float32)[:, :, None, :]).sum(-1) * scale  # [B, Hkv, G]
    top = torch.maximum(past.amax(dim=1), own)
    p_past = torch.exp(past - top[:, None])
    p_own = torch.exp(own - top)
    values = torch.where(mask, cast(past_v, torch.float32), 0.0)[:, :, :, None, :]  # [B, L, Hkv, 1, D]
    out = (p_past[..., None] * values).sum(1) + p_own[..., None] * cast(v, torch.float32)[:, :, None, :]
    out = out / (p_past.sum(1) + p_own)[..., None]  # [B, Hkv, G, D]
    return out.reshape(num_seqs, heads, head_dim)


def _mark_pool_static(kv_cache: torch.Tensor) -> None:
    """Every dimension of the KV pool but the number of blocks is fixed by the model: no symbols for
    them (one of size 2 or 3 would otherwise share a symbol with a batch of that size). The number of
    blocks stays symbolic, so that a graph cached on disk serves any pool size."""
    for dim in range(1, kv_cache.dim()):
        torch._dynamo.mark_static(kv_cache, dim)


def _inputs_guards_only(entries) -> list[bool]:
    """Keep the guards on the step's inputs (their sizes, strides, dtypes: which graph fits) and on
    torch's global state; drop those on the model (``self.*``: ~300 weight tensors and its settings)
    and on module globals, neither of which changes once the model is loaded."""
    return [not e.name.startswith(("self", "G[")) for e in entries]
