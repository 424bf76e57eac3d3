"""A Llama-family decoder (Llama 2/3, SmolLM/SmolLM2/SmolLM3, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, Granite,
Gemma 2, Gemma 3, and with experts Mixtral, Qwen3-MoE and gpt-oss) over a paged KV cache.

Weights are plain tensors (q/k/v and gate/up fused into one matmul each); attention, the KV
write, the residual add + RMSNorm and rotary go through an ``AttentionBackend`` (the kernel seam,
shared/model/attention.py), so the same model runs on the torch references or on Triton kernels.
All sequences of a step are flattened into one token dimension ``T``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from kernels import blocks_cpu, fused_cpu, int8_cpu
from kernels.cast import cast
from kernels.rms_norm import fused_add_rms_norm_ref
from shared.kvcache.layout import KvCacheSpec, layer_views
from shared.model.attention import (AttentionBackend, AttentionMetadata, TorchAttentionBackend, chunk_metadata,
                                    gathered_attention)
from shared.model.config import ModelConfig, RopeScaling, YarnScaling
from shared.model.moe import moe_block
from shared.model.parallel import Collectives, PipelineStage, SingleRank, TensorSplit, pipeline_chunks
from shared.model.quant import BlockWeight, Int8Weight, ObservedWeight, linear, observe, quantize_blocks, quantize_int8


log = logging.getLogger(__name__)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2], with Llama-3 or YaRN scaling or GGUF freq factors applied."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if cfg.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float64)
    elif isinstance(cfg.rope_scaling, YarnScaling):
        inv_freq = _yarn_inv_freq(inv_freq, cfg.rope_scaling, cfg.rope_theta, dim)
    elif isinstance(cfg.rope_scaling, RopeScaling):
        s = cfg.rope_scaling
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        mid = (1 - smooth) * scaled / s.factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq.float()


def _yarn_inv_freq(inv_freq: torch.Tensor, s: YarnScaling, base: float, dim: int) -> torch.Tensor:
    """YaRN's blend (as transformers' ``_compute_yarn_parameters``): the dimensions that turn more than
    beta_fast times over the original context keep their frequency, those under beta_slow times are
    divided by the factor, a linear ramp between."""
    def dimension(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the context
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv_freq / s.factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
    s = cfg.rope_scaling
    if not isinstance(s, YarnScaling):
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    return mscale(s.factor)


LINEAR_NAMES = ("qkv", "o_proj", "gate_up", "down")  # a layer's linear weights (quantize replaces them)


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}

Norm = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # fused_add_rms_norm(x, residual, weight, eps)


class LlamaLayer:
    """One decoder layer; on a tensor-parallel rank, its heads and MLP channels
    (shared/model/parallel.py), the two row-parallel products summed over the group.

    What a family changes (shared/model/config.py's ``FAMILIES``) arrives as the config's fields
    and as which norms the weights hold: no norm before a sublayer (OLMo 2), a norm of a
    sublayer's all-reduced output (OLMo 2, Gemma), the MLP's activation, Granite's residual
    multiplier, the softmax scale and Gemma 2's score soft-cap, gpt-oss's sinks and o_proj bias, the layer's
    sliding window; SmolLM3's layers without rotary and experts in place of the MLP (shared/model/moe.py:
    Mixtral, Qwen3-MoE, gpt-oss).
    The compiled decode step (shared/engine/compiled/step.py) covers the Llama layer and Qwen3's q/k norms;
    the other families decode eagerly (``compiled.unsupported_reason``)."""

    linear_names = LINEAR_NAMES  # the linear weights ``LlamaModel.quantize`` replaces

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], split: TensorSplit,
                 group: Collectives, index: int = 0):
        self.cfg = cfg
        self.group = group
        self.attn_norm = weights.get("attn_norm")  # [hidden]; None: no norm before attention (OLMo 2)
        self.qkv = weights["qkv"]  # [(Hq + 2 Hkv) * D, hidden]
        self.qkv_bias = weights.get("qkv_bias")
        self.o_proj = weights["o_proj"]
        self.o_bias = weights.get("o_bias")  # [hidden] (gpt-oss): added once, after the all-reduce
        self.sinks = weights.get("sinks")  # [Hq] (gpt-oss): each head's sink logit (``attend``)
        self.attn_out_norm = weights.get("attn_out_norm")  # [hidden]: of attention's output (OLMo 2, Gemma)
        self.mlp_norm = weights.get("mlp_norm")
        self.gate_up = weights.get("gate_up")  # [2 * intermediate, hidden]; None in a layer of experts
        self.down = weights.get("down")
        self.mlp_out_norm = weights.get("mlp_out_norm")
        self.num_heads, self.num_kv_heads = split.num_heads, split.num_kv_heads  # this rank's
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        # settled here, once, not in every forward
        self.scale = cfg.attention_scale or cfg.head_dim ** -0.5
        self.softcap = cfg.attn_softcap
        self.residual_multiplier = cfg.residual_multiplier if cfg.residual_multiplier != 1.0 else None
        self.act = _ACTIVATIONS[cfg.activation]
        self.rope = (1 if index in cfg.local_layers else 0) if cfg.local_layers else None  # Gemma 3's cos/sin pair
        self.has_rope = index not in cfg.nope_layers  # SmolLM3's NoPE layers attend without positions
        self.window = cfg.layer_window(index)  # a sliding-window layer's: it sees its last `window` positions
        self.moe = moe_block(cfg.moe, weights, self.act) if "router" in weights else None

    def forward(self, kv_views, hidden, residual, cos, sin, meta, backend):
        norm = backend.fused_add_rms_norm
        x, residual = self.norm_in(norm, hidden, residual, self.attn_norm)
        q, k, v = self.project_qkv(x, cos, sin, backend.rotary_embedding)
        k_cache, v_cache = kv_views
        backend.write_kv(k, v, k_cache, v_cache, meta)
        attn = self.group.all_reduce(linear(self.attend(q, kv_views, meta, backend).reshape(-1, self.q_size),
                                            self.o_proj))
        hidden = self.norm_out(norm, attn if self.o_bias is None else attn + self.o_bias, self.attn_out_norm)
        x, residual = self.norm_in(norm, hidden, residual, self.mlp_norm)
        return self.norm_out(norm, self.group.all_reduce(self.mlp(x)), self.mlp_out_norm), residual

    def attend(self, q: torch.Tensor, kv_views, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """The backend's attention, or, where the family changes the softmax (Gemma 2's soft-cap, gpt-oss's
        sinks), torch over K/V gathered from the cache on every backend: no kernel takes either."""
        k_cache, v_cache = kv_views
        if self.softcap is None and self.sinks is None:
            return backend.attend(q, k_cache, v_cache, meta, self.scale, self.window)
        return gathered_attention(q, k_cache, v_cache, meta, self.scale, self.window, softcap=self.softcap,
                                  sinks=self.sinks)

    def norm_in(self, norm: Norm, hidden, residual, weight) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sublayer's input, the residual stream): hidden + residual, normed unless ``weight`` is None."""
        if weight is not None:
            return norm(hidden, residual, weight, self.cfg.rms_norm_eps)
        summed = hidden if residual is None else hidden + residual
        return summed, summed

    def norm_out(self, norm: Norm, out: torch.Tensor, weight) -> torch.Tensor:
        """A sublayer's all-reduced output as it joins the residual stream."""
        if weight is not None:
            out = norm(out, None, weight, self.cfg.rms_norm_eps)[0]
        return out if self.residual_multiplier is None else out * self.residual_multiplier

    def project_qkv(self, x, cos, sin, rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] of this rank's heads, q and k normed and rotated."""
        q, k, v = linear(x, self.qkv, self.qkv_bias).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.norm_qk(q, k)
        if self.rope is not None:
            cos, sin = cos[self.rope], sin[self.rope]
        q = q.reshape(-1, self.num_heads, self.cfg.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.cfg.head_dim)
        if self.has_rope:
            q, k = rotary(q, k, cos, sin)
        return q, k, v.reshape(-1, self.num_kv_heads, self.cfg.head_dim)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> this rank's partial sum [T, hidden]
        if self.moe is not None:
            return self.moe.forward(x)
        gate_up = linear(x, self.gate_up)
        if self.act is F.silu:  # one pass on a CPU with AVX-512F (kernels/fused_cpu.py)
            return linear(fused_cpu.silu_mul(gate_up), self.down)
        gate, up = gate_up.chunk(2, dim=-1)
        return linear(self.act(gate) * up, self.down)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The hook between the q/k projections ([T, Hq * D], [T, Hkv * D]) and rotary: none in Llama."""
        return q, k


class QkNormLayer(LlamaLayer):
    """Qwen3's and Gemma 3's layer: RMSNorm over each head of q and of k (weights [D], the same for
    every head and so whole on every tensor-parallel rank) between the projections and rotary."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], split: TensorSplit,
                 group: Collectives, index: int = 0):
        super().__init__(cfg, weights, split, group, index)
        self.q_norm, self.k_norm = weights["q_norm"], weights["k_norm"]  # [D] each

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps, d = self.cfg.rms_norm_eps, self.cfg.head_dim
        q = fused_add_rms_norm_ref(q.reshape(-1, self.num_heads, d), None, self.q_norm, eps)[0]
        return q, fused_add_rms_norm_ref(k.reshape(-1, self.num_kv_heads, d), None, self.k_norm, eps)[0]


class WholeQkNormLayer(QkNormLayer):
    """OLMo 2's layer: RMSNorm over all of q and all of k (weights [Hq * D] and [Hkv * D]). On a
    tensor-parallel rank, its heads' part of each weight, and the mean square averaged over the group."""

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        if self.group.size == 1:
            q = fused_add_rms_norm_ref(q, None, self.q_norm, eps)[0]
            return q, fused_add_rms_norm_ref(k, None, self.k_norm, eps)[0]
        # every rank holds as many heads of q (of k) as the next, so the mean square over all of them is the
        # mean of the ranks' (a KV head replicated on n ranks counts n times, as each of its peers does)
        local = torch.stack([cast(q, torch.float32).pow(2).mean(-1), cast(k, torch.float32).pow(2).mean(-1)])
        mean = self.group.all_reduce(local) / self.group.size  # [2, T]
        q = self.q_norm * cast(cast(q, torch.float32) * torch.rsqrt(mean[0, :, None] + eps), q.dtype)
        return q, self.k_norm * cast(cast(k, torch.float32) * torch.rsqrt(mean[1, :, None] + eps), k.dtype)


def layer_class(cfg: ModelConfig) -> type[LlamaLayer]:
    """The decoder layer of ``cfg``'s family (shared/model/config.py's ``FAMILIES``)."""
    if cfg.mla is not None:  # shared/model/mla.py builds on LlamaLayer: imported here, not at the top
        from shared.model.mla import MlaLayer
        return MlaLayer
    return {None: LlamaLayer, "head": QkNormLayer, "whole": WholeQkNormLayer}[cfg.qk_norm]


@dataclasses.dataclass
class LayerState:
    """A forward between two layers (``LlamaModel.run_layers``): the hidden states and residual
    after ``next_layer`` layers, and the rotary angles of its tokens."""

    hidden: torch.Tensor
    residual: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    next_layer: int = 0


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], layer_weights: Iterable[dict],
                 group: Collectives | None = None, pipeline: PipelineStage | None = None,
                 quantize_layers: str | None = None):
        """``weights`` and ``layer_weights``: the whole model's, or with ``group`` of more than one
        rank, this rank's shard of them (``shared.model.parallel.shard_top`` and ``shard_layer``);
        with ``pipeline``, its stage's layers only (and the embedding and LM head on stage 0 alone).
        ``quantize_layers`` (one of ``LAYERWISE_QUANTIZATIONS``): each layer quantized as soon as it is
        made, before the next layer's weights are taken from ``layer_weights`` (an iterator that reads
        them as it goes), so a load holds one layer in float at a time, not the whole model;
        ``quantize`` then does the rest (the LM head)."""
        self.cfg = cfg
        self.group = group or SingleRank()
        self.pipeline = pipeline or PipelineStage(self.group, 0, 1, self.group.size, range(cfg.num_layers))
        self.split = TensorSplit(cfg, self.group.rank, self.group.size)
        self.embed = weights.get("embed")  # [V, hidden]; [V / tp, hidden] on a rank of a group; None past stage 0
        self.norm = weights["norm"]
        self.lm_head = weights.get("lm_head", self.embed)
        # Granite's embedding_multiplier, Gemma's sqrt(hidden): in the model's dtype, as Gemma rounds it
        self.embed_scale = (torch.tensor(cfg.embedding_multiplier, dtype=self.norm.dtype, device=self.norm.device)
                            if cfg.embedding_multiplier != 1.0 else None)
        self.layers = []
        for i, w in zip(self.pipeline.layers, layer_weights, strict=True):
            self.layers.append(layer_class(cfg)(cfg, w, self.split, self.group, i))
            if quantize_layers is not None:
                quantize_layer(self.layers[-1], quantize_layers, i)
        self.layers_quantized = quantize_layers  # the method the layers already hold, or None
        if cfg.attention_sinks:
            log.info("%s: attention sinks: every layer attends in torch over K/V gathered from the cache, not by "
                     "the attention backend's kernels (no kernel takes sinks)", cfg.architecture)
        self.inv_freq = rope_inv_freq(cfg).to(self.norm.device)
        self.rope_factor = rope_attention_factor(cfg)  # YaRN's scale of cos and sin (of the global layers')
        self.local_inv_freq = None  # Gemma 3's sliding-window layers' own base (no scaling)
        if cfg.local_layers:
            local = dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None, rope_freq_factors=None)
            self.local_inv_freq = rope_inv_freq(local).to(self.norm.device)
        self._kv_views: tuple[torch.Tensor, list] | None = None  # (cache, each layer's (k, v) views)
        self.num_pipelined_steps = 0  # prefill steps run in chunks overlapped across pipeline stages

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this process computes and caches (all of them outside a parallel group)."""
        return self.split.num_kv_heads

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.group.size == 1:
            rows = F.embedding(input_ids, self.embed)
        else:  # vocab-parallel: the rank holding a token's row gives it, the others zeros
            local = input_ids - self.split.vocab_start
            mine = (local >= 0) & (local < self.split.vocab_shard)
            rows = F.embedding(torch.where(mine, local, 0), self.embed)
            rows = self.group.all_reduce(torch.where(mine[:, None], rows, 0.0))
        return rows if self.embed_scale is None else rows * self.embed_scale

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D/2]; with local layers (Gemma 3) [2, T, D/2]: the global layers' and the
        local ones' (each layer picks its own: ``LlamaLayer.rope``)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos() * self.rope_factor, freqs.sin() * self.rope_factor  # x 1.0 leaves the bits
        if self.local_inv_freq is not None:
            local = positions.float()[:, None] * self.local_inv_freq[None, :]
            cos, sin = torch.stack([cos, local.cos()]), torch.stack([sin, local.sin()])
        return cos.to(self.dtype), sin.to(self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [N, L, 2, bs, Hkv, D]: this stage's L layers
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor | None:  # [T, hidden]; None past a pipeline's stage 0
        """Every rank of a pipeline calls it for the same step: the stages run their layers one
        after the other, each handing (hidden, residual) on to the next, the last back to stage 0;
        one long prompt's prefill in chunks that overlap across the stages (``pipeline_chunks``)."""
        cos, sin = self.rope_cos_sin(positions)
        pipe = self.pipeline
        shape = (input_ids.shape[0], self.cfg.hidden_size)
        chunks = pipeline_chunks(input_ids.shape[0], meta.num_decodes, meta.seq_lens.shape[0], pipe.num_stages)
        if len(chunks) > 1:
            hidden, residual = self._run_pipelined(input_ids, cos, sin, kv_cache, meta, backend, chunks)
        else:
            hidden = residual = None
            if pipe.stage == 0:
                hidden, residual = self._run_stage(self.embed_tokens(input_ids), None, cos, sin, kv_cache, meta,
                                                   backend)
            for stage in range(1, pipe.num_stages):
                hidden, residual = pipe.hand_over(stage - 1, hidden, residual, shape, self.dtype, self.device)
                if pipe.stage == stage:
                    hidden, residual = self._run_stage(hidden, residual, cos, sin, kv_cache, meta, backend)
        if pipe.num_stages > 1:
            hidden, residual = pipe.hand_over(pipe.num_stages - 1, hidden, residual, shape, self.dtype, self.device)
        if pipe.stage != 0:
            return None
        return backend.fused_add_rms_norm(hidden, residual, self.norm, self.cfg.rms_norm_eps)[0]

    def _run_pipelined(self, input_ids, cos, sin, kv_cache, meta, backend, chunks):
        """One prompt's prefill in ``chunks`` of its tokens, overlapped across the stages: in round
        t this stage runs chunk t - stage, then every stage hands the chunk it ran to the next (one
        broadcast each, in stage order, on every rank). Returns the last stage's (hidden, residual)
        of every token there, None elsewhere. A chunk's attention reads the earlier chunks' KV, which
        this stage wrote in earlier rounds: the same operations as a chunked prefill."""
        pipe, width = self.pipeline, self.cfg.hidden_size
        last = pipe.num_stages - 1
        self.num_pipelined_steps += 1
        received: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        done: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t in range(len(chunks) + last):
            ran = None
            m = t - pipe.stage
            if 0 <= m < len(chunks):
                lo, hi = chunks[m]
                part = chunk_metadata(meta, lo, hi, input_ids.shape[0])
                if pipe.stage == 0:
                    hidden, residual = self.embed_tokens(input_ids[lo:hi]), None
                else:
                    hidden, residual = received.pop(m)
                ran = self._run_stage(hidden, residual, cos[..., lo:hi, :], sin[..., lo:hi, :], kv_cache, part,
                                      backend)
                if pipe.stage == last:
                    done.append(ran)
            for src in range(last):  # hand-offs of this round, the same order on every rank
                k = t - src
                if 0 <= k < len(chunks):
                    shape = (chunks[k][1] - chunks[k][0], width)
                    mine = ran if pipe.stage == src else (None, None)
                    handed = pipe.hand_over(src, *mine, shape, self.dtype, self.device)
                    if pipe.stage == src + 1:
                        received[k] = handed
        if pipe.stage != last:
            return None, None
        return torch.cat([h for h, _ in done]), torch.cat([r for _, r in done])

    def _run_stage(self, hidden, residual, cos, sin, kv_cache, meta, backend):
        for layer, views in zip(self.layers, self.kv_views(kv_cache)):
            hidden, residual = layer.forward(views, hidden, residual, cos, sin, meta, backend)
        return hidden, residual

    @torch.inference_mode()
    def start_layers(self, input_ids: torch.Tensor, positions: torch.Tensor) -> LayerState:
        """``forward`` a layer at a time: its embedding and rotary angles, before the first layer."""
        cos, sin = self.rope_cos_sin(positions)
        return LayerState(self.embed_tokens(input_ids), None, cos, sin)

    @torch.inference_mode()
    def run_layers(self, state: LayerState, kv_cache: torch.Tensor, meta: AttentionMetadata,
                   backend: AttentionBackend, stop: Callable[[], bool] | None = None) -> bool:
        """Run ``state``'s remaining layers, asking ``stop()`` after each: True when every layer ran,
        False when ``stop`` said so first (call again later to go on). The same operations as
        ``forward`` in the same order, so the result has the same bits however often it stopped."""
        views = self.kv_views(kv_cache)
        while state.next_layer < len(self.layers):
            i = state.next_layer
            state.hidden, state.residual = self.layers[i].forward(views[i], state.hidden, state.residual, state.cos,
                                                                  state.sin, meta, backend)
            state.next_layer = i + 1
            if stop is not None and state.next_layer < len(self.layers) and stop():
                return False
        return True

    @torch.inference_mode()
    def finish_layers(self, state: LayerState, backend: AttentionBackend) -> torch.Tensor:  # [T, hidden]
        return backend.fused_add_rms_norm(state.hidden, state.residual, self.norm, self.cfg.rms_norm_eps)[0]

    def kv_views(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (k, v) views of ``kv_cache``, made once for the engine's cache (every step
        passes the same tensor) rather than sliced again in every layer of every step."""
        if self._kv_views is None or self._kv_views[0] is not kv_cache:
            self._kv_views = (kv_cache, [layer_views(kv_cache, i) for i in range(len(self.layers))])
        return self._kv_views[1]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [S, hidden] -> [S, V] float32
        """On a rank of a group every rank of stage 0 calls it with the same ``hidden`` and gets every
        logit; past stage 0 (no LM head) None."""
        if self.lm_head is None:
            return None
        logits = linear(hidden, self.lm_head).float()
        if self.group.size > 1:
            logits = self.group.all_gather(logits)[:, :self.cfg.vocab_size]
        return self.scale_logits(logits)

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Granite's division by ``logits_scaling``, Gemma 2's final soft-cap."""
        cfg = self.cfg
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    def quantize(self, method: str, calibration_ids: list[int] | None = None, alpha: float = 0.5) -> None:
        """Replace every linear weight (and the LM head, a copy when tied) by its int8 form.

        "int8": one int8 level of weights and activations; with ``calibration_ids`` the float model
        first runs that text once, recording each linear layer's per-channel input range, and the
        weights are smoothed with it (SmoothQuant, alpha). "int8-precise": activations in two int8
        levels, the LM head's weight too, no smoothing (``calibration_ids`` unused; ``shared/model/quant.py``).
        "gguf": weight-only blocks of 32 (``BlockWeight``: 4-bit where a weight is on a 4-bit grid, as
        a GGUF file's Q4 layers are, else 8-bit), activations rounded to 8-bit blocks as llama.cpp does
        (``kernels/blocks_cpu.py``); a weight whose rows are not whole blocks of 32 stays float, and so
        do a layer's experts (``MoeBlock.quantize_gguf``, ``quantize_int8`` for the int8 methods)."""
        if method == "none":
            return
        if self.layers_quantized not in (None, method):
            raise ValueError(f"the layers were loaded as {self.layers_quantized}, not {method}")
        if method == "gguf":
            if self.layers_quantized is None:
                for i, layer in enumerate(self.layers):
                    quantize_layer(layer, method, i)
            head = quantize_blocks(self.lm_head) if self.lm_head is not None else None  # none past stage 0
            self.lm_head = dataclasses.replace(head, act_levels=2) if head is not None else self.lm_head
            if self.device.type == "cpu":
                blocks_cpu.load()  # the block kernel (built once per machine; panels with VNNI), or the reference
            return
        assert method in ("int8", "int8-precise"), method
        levels = 2 if method == "int8-precise" else 1
        if calibration_ids and levels == 1:
            for layer in self.layers:
                for name in _linear_names(layer):
                    setattr(layer, name, observe(getattr(layer, name)))
            self.lm_head = observe(self.lm_head) if self.lm_head is not None else None
            self.prefill_logits(calibration_ids)  # every position: the LM head's calibration sees them all
        if self.layers_quantized is None:
            for i, layer in enumerate(self.layers):
                quantize_layer(layer, method, i, alpha)
        if self.lm_head is not None:
            self.lm_head = _to_int8(self.lm_head, alpha, levels == 2, levels)
        if self.device.type == "cpu":
            int8_cpu.load()  # the few-row kernel (built once per machine), or torch._int_mm: same bits

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int], block_size: int = 16,
                       kv_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Float32 logits [n, V] at every position of one prefill of ``token_ids``, over a scratch
        KV cache (of ``kv_dtype``, default the model's): for calibration and for measuring a model
        against another."""
        cfg, n, dev = self.cfg, len(token_ids), self.device
        num_blocks = -(-n // block_size)
        kv = KvCacheSpec(len(self.layers), self.num_kv_heads, cfg.head_dim, block_size, kv_dtype or self.dtype).allocate(
            num_blocks, dev)
        meta = AttentionMetadata(
            num_decodes=0, slot_mapping=torch.arange(n, device=dev),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None],
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev), max_seq_len=n, max_query_len=n)
        hidden = self.forward(torch.tensor(token_ids, device=dev), torch.arange(n, device=dev), kv, meta,
                              TorchAttentionBackend())
        return self.compute_logits(hidden)

    @property
    def quantization(self) -> str:
        first = self.layers[0]
        weights = [self.lm_head, *(getattr(first, name) for name in first.linear_names)]
        if any(isinstance(w, BlockWeight) for w in weights):
            return "gguf"
        int8 = next((w for w in weights if isinstance(w, Int8Weight)), None)
        if int8 is None:
            return "none"
        return "int8-precise" if int8.act_levels == 2 else "int8"


# the methods that need no calibration run of the whole float model: a load can quantize each layer as
# soon as it is made (``LlamaModel(quantize_layers=...)``)
LAYERWISE_QUANTIZATIONS = ("gguf", "int8-precise")


def quantize_layer(layer: LlamaLayer, method: str, index: int, alpha: float = 0.5) -> None:
    """One layer's linear weights and experts in ``method``'s form (``LlamaModel.quantize`` says what
    each method holds); an int8 weight observed by a calibration run is smoothed with what it saw."""
    if method == "gguf":
        for name in _linear_names(layer):
            setattr(layer, name, quantize_blocks(getattr(layer, name)) or getattr(layer, name))
        if layer.moe is not None and not layer.moe.quantize_gguf():
            log.info("layer %d's experts stay float: their input width is not whole blocks of 32", index)
        return
    assert method in ("int8", "int8-precise"), method
    levels = 2 if method == "int8-precise" else 1
    for name in _linear_names(layer):
        setattr(layer, name, _to_int8(getattr(layer, name), alpha, False, levels))
    if layer.moe is not None:
        layer.moe.quantize_int8(levels)


def _linear_names(layer: LlamaLayer) -> list[str]:
    """The linear weights a layer holds (its class's ``linear_names``): a layer of experts has no gate_up
    or down, a latent-attention layer no qkv."""
    return [name for name in layer.linear_names if getattr(layer, name) is not None]


def _to_int8(weight: torch.Tensor | ObservedWeight, alpha: float, residual: bool, act_levels: int) -> Int8Weight:
    if isinstance(weight, ObservedWeight):
        return quantize_int8(weight.weight, weight.act_amax, alpha, residual, act_levels)
    return quantize_int8(weight, residual=residual, act_levels=act_levels)
