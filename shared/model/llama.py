"""A Llama-family decoder (Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2, Qwen3, Phi-3) over a paged KV cache.

Weights are plain tensors (q/k/v and gate/up fused into one matmul each); attention, the KV
write, the residual add + RMSNorm and rotary go through an ``AttentionBackend`` (the kernel seam,
shared/model/attention.py), so the same model runs on the torch references or on Triton kernels.
All sequences of a step are flattened into one token dimension ``T``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import blocks_cpu, int8_cpu
from kernels.rms_norm import fused_add_rms_norm_ref
from shared.kvcache.layout import KvCacheSpec, layer_views
from shared.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from shared.model.config import ModelConfig
from shared.model.parallel import Collectives, PipelineStage, SingleRank, TensorSplit
from shared.model.quant import BlockWeight, Int8Weight, ObservedWeight, linear, observe, quantize_blocks, quantize_int8


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with Llama-3 scaling or GGUF freq factors applied."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if cfg.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float64)
    elif cfg.rope_scaling is not None:
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


LINEAR_NAMES = ("qkv", "o_proj", "gate_up", "down")  # a layer's linear weights (quantize replaces them)


class LlamaLayer:
    """One decoder layer; on a tensor-parallel rank, its heads and MLP channels
    (shared/model/parallel.py), the two row-parallel products summed over the group."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], split: TensorSplit,
                 group: Collectives):
        self.cfg = cfg
        self.group = group
        self.attn_norm = weights["attn_norm"]
        self.qkv = weights["qkv"]  # [(Hq + 2 Hkv) * D, hidden]
        self.qkv_bias = weights.get("qkv_bias")
        self.o_proj = weights["o_proj"]
        self.mlp_norm = weights["mlp_norm"]
        self.gate_up = weights["gate_up"]  # [2 * intermediate, hidden]
        self.down = weights["down"]
        self.num_heads, self.num_kv_heads = split.num_heads, split.num_kv_heads  # this rank's
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim

    def forward(self, kv_views, hidden, residual, cos, sin, meta, backend):
        cfg = self.cfg
        x, residual = backend.fused_add_rms_norm(hidden, residual, self.attn_norm, cfg.rms_norm_eps)
        qkv = linear(x, self.qkv, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, cfg.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        q, k = self.norm_qk(q, k)
        q, k = backend.rotary_embedding(q, k, cos, sin)
        v = v.view(-1, self.num_kv_heads, cfg.head_dim)
        k_cache, v_cache = kv_views
        backend.write_kv(k, v, k_cache, v_cache, meta)
        attn = backend.attend(q, k_cache, v_cache, meta, cfg.head_dim ** -0.5)
        hidden = self.group.all_reduce(linear(attn.reshape(-1, self.q_size), self.o_proj))
        x, residual = backend.fused_add_rms_norm(hidden, residual, self.mlp_norm, cfg.rms_norm_eps)
        gate, up = linear(x, self.gate_up).chunk(2, dim=-1)
        return self.group.all_reduce(linear(F.silu(gate) * up, self.down)), residual

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The hook between the q/k projections and rotary ([T, H, D] each): none in Llama."""
        return q, k


class QkNormLayer(LlamaLayer):
    """Qwen3's layer: RMSNorm over each head of q and of k (weights [D], the same for every head and
    so whole on every tensor-parallel rank) between the projections and rotary."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], split: TensorSplit,
                 group: Collectives):
        super().__init__(cfg, weights, split, group)
        self.q_norm, self.k_norm = weights["q_norm"], weights["k_norm"]  # [D] each

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        q = fused_add_rms_norm_ref(q, None, self.q_norm, eps)[0]
        return q, fused_add_rms_norm_ref(k, None, self.k_norm, eps)[0]


def layer_class(cfg: ModelConfig) -> type[LlamaLayer]:
    """The decoder layer of ``cfg``'s family (shared/model/config.py's ``FAMILIES``)."""
    return QkNormLayer if cfg.qk_norm else LlamaLayer


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
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], layer_weights: list[dict],
                 group: Collectives | None = None, pipeline: PipelineStage | None = None):
        """``weights`` and ``layer_weights``: the whole model's, or with ``group`` of more than one
        rank, this rank's shard of them (``shared.model.parallel.shard_top`` and ``shard_layer``);
        with ``pipeline``, its stage's layers only (and the embedding and LM head on stage 0 alone)."""
        self.cfg = cfg
        self.group = group or SingleRank()
        self.pipeline = pipeline or PipelineStage(self.group, 0, 1, self.group.size, range(cfg.num_layers))
        self.split = TensorSplit(cfg, self.group.rank, self.group.size)
        self.embed = weights.get("embed")  # [V, hidden]; [V / tp, hidden] on a rank of a group; None past stage 0
        self.norm = weights["norm"]
        self.lm_head = weights.get("lm_head", self.embed)
        self.layers = [layer_class(cfg)(cfg, w, self.split, self.group) for w in layer_weights]
        self.inv_freq = rope_inv_freq(cfg).to(self.norm.device)
        self._kv_views: tuple[torch.Tensor, list] | None = None  # (cache, each layer's (k, v) views)

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
            return F.embedding(input_ids, self.embed)
        # vocab-parallel: the rank holding a token's row gives it, the others zeros
        local = input_ids - self.split.vocab_start
        mine = (local >= 0) & (local < self.split.vocab_shard)
        rows = F.embedding(torch.where(mine, local, 0), self.embed)
        return self.group.all_reduce(torch.where(mine[:, None], rows, 0.0))

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        return freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)

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
        after the other, each handing (hidden, residual) on to the next, the last back to stage 0."""
        cos, sin = self.rope_cos_sin(positions)
        pipe = self.pipeline
        hidden = residual = None
        if pipe.stage == 0:
            hidden, residual = self._run_stage(self.embed_tokens(input_ids), None, cos, sin, kv_cache, meta, backend)
        shape = (input_ids.shape[0], self.cfg.hidden_size)
        for stage in range(1, pipe.num_stages):
            hidden, residual = pipe.hand_over(stage - 1, hidden, residual, shape, self.dtype, self.device)
            if pipe.stage == stage:
                hidden, residual = self._run_stage(hidden, residual, cos, sin, kv_cache, meta, backend)
        if pipe.num_stages > 1:
            hidden, residual = pipe.hand_over(pipe.num_stages - 1, hidden, residual, shape, self.dtype, self.device)
        if pipe.stage != 0:
            return None
        return backend.fused_add_rms_norm(hidden, residual, self.norm, self.cfg.rms_norm_eps)[0]

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
        if self.group.size == 1:
            return logits
        return self.group.all_gather(logits)[:, :self.cfg.vocab_size]

    def quantize(self, method: str, calibration_ids: list[int] | None = None, alpha: float = 0.5) -> None:
        """Replace every linear weight (and the LM head, a copy when tied) by its int8 form.

        "int8": one int8 level of weights and activations; with ``calibration_ids`` the float model
        first runs that text once, recording each linear layer's per-channel input range, and the
        weights are smoothed with it (SmoothQuant, alpha). "int8-precise": activations in two int8
        levels, the LM head's weight too, no smoothing (``calibration_ids`` unused; ``shared/model/quant.py``).
        "gguf": weight-only blocks of 32 (``BlockWeight``: 4-bit where a weight is on a 4-bit grid, as
        a GGUF file's Q4 layers are, else 8-bit), activations rounded to 8-bit blocks as llama.cpp does
        (``kernels/blocks_cpu.py``); a weight whose rows are not whole blocks of 32 stays float."""
        if method == "none":
            return
        if method == "gguf":
            for layer in self.layers:
                for name in LINEAR_NAMES:
                    setattr(layer, name, quantize_blocks(getattr(layer, name)) or getattr(layer, name))
            head = quantize_blocks(self.lm_head) if self.lm_head is not None else None  # none past stage 0
            self.lm_head = dataclasses.replace(head, act_levels=2) if head is not None else self.lm_head
            if self.device.type == "cpu":
                blocks_cpu.load()  # the block kernel (built once per machine; panels with VNNI), or the reference
            return
        assert method in ("int8", "int8-precise"), method
        levels = 2 if method == "int8-precise" else 1
        if calibration_ids and levels == 1:
            for layer in self.layers:
                for name in LINEAR_NAMES:
                    setattr(layer, name, observe(getattr(layer, name)))
            self.lm_head = observe(self.lm_head) if self.lm_head is not None else None
            self.prefill_logits(calibration_ids)  # every position: the LM head's calibration sees them all
        for layer in self.layers:
            for name in LINEAR_NAMES:
                setattr(layer, name, _to_int8(getattr(layer, name), alpha, False, levels))
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
        if any(isinstance(w, BlockWeight) for w in (self.lm_head, self.layers[0].qkv, self.layers[0].gate_up)):
            return "gguf"
        int8 = next((w for w in (self.lm_head, self.layers[0].qkv) if isinstance(w, Int8Weight)), None)
        if int8 is None:
            return "none"
        return "int8-precise" if int8.act_levels == 2 else "int8"


def _to_int8(weight: torch.Tensor | ObservedWeight, alpha: float, residual: bool, act_levels: int) -> Int8Weight:
    if isinstance(weight, ObservedWeight):
        return quantize_int8(weight.weight, weight.act_amax, alpha, residual, act_levels)
    return quantize_int8(weight, residual=residual, act_levels=act_levels)
