"""Model shape and hyper-parameters, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (``rope_type == "llama3"``); factors as in HF configs."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (``rope_type == "yarn"``: gpt-oss): each frequency blended between itself and itself / factor
    by a ramp over the dimensions whose wavelengths lie between beta_fast and beta_slow rotations in the
    original context, and cos and sin scaled by an attention factor (``shared.model.llama.rope_inv_freq``
    and ``rope_attention_factor``); fields as in HF configs."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # the ramp's ends rounded out to whole dimensions
    attention_factor: float | None = None  # None: 0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio
    mscale: float | None = None
    mscale_all_dim: float | None = None


@dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's expert activation: gate clamped above at ``limit``, up to [-limit, limit], and
    (up + 1) * gate * sigmoid(alpha * gate) in place of silu(gate) * up."""

    alpha: float
    limit: float


@dataclass(frozen=True)
class GroupLimitedRouting:
    """DeepSeek-V3's router (``shared.model.moe.GroupLimitedMoeBlock``): a sigmoid score per expert, chosen
    by score + ``e_score_correction_bias`` among the experts of the ``topk_groups`` best of ``num_groups``
    groups (a group's worth: its two best biased scores), weighted by the unbiased scores (renormalised where
    ``Moe.renormalize``) times ``routed_scaling_factor``; plus ``num_shared_experts`` experts every token
    takes, one SwiGLU ``num_shared_experts`` times as wide as a routed one."""

    num_groups: int
    topk_groups: int
    routed_scaling_factor: float
    num_shared_experts: int


@dataclass(frozen=True)
class Moe:
    """A mixture of experts in place of the MLP (Mixtral, Qwen3-MoE): a router picks ``top_k`` of
    ``num_experts`` SwiGLU experts of width ``intermediate_size`` for each token, weighted by their
    softmax probabilities (renormalised over the chosen k where ``renormalize``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    # the weights rounded to the model's dtype before they scale the experts' outputs (Qwen3-MoE), else
    # kept in float32 (Mixtral): the same in float32, a bit or so apart below it
    round_weights: bool
    layers: tuple[int, ...]  # the layers with experts; the others keep the dense MLP (Qwen3-MoE's mlp_only_layers)
    # gpt-oss: the softmax over the top k logits alone (the same weights as renormalising, rounded apart)
    softmax_after_topk: bool = False
    clamped_swiglu: ClampedSwiglu | None = None  # gpt-oss's expert activation; None: the model's act(gate) * up
    group_limited: GroupLimitedRouting | None = None  # DeepSeek-V3's router and shared experts


@dataclass(frozen=True)
class Mla:
    """DeepSeek's multi-head latent attention (``shared.model.mla``): q through a low-rank ``q_lora_rank``
    bottleneck (None: one q_proj), keys and values made per head from one compressed latent of
    ``kv_lora_rank`` channels and one rotated key of ``qk_rope_head_dim`` shared by every head."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the rope channels rotate in interleaved pairs (x0, x1), (x2, x3), ...

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """What the pool holds per token and layer: the compressed kv, then the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeNames:
    """Where a family's config.json keeps its mixture of experts."""

    width: str  # the key of each expert's intermediate width
    renormalize: bool | None  # the top-k weights summed to 1 (Mixtral: always); None: config's norm_topk_prob
    round_weights: bool  # Moe.round_weights
    softmax_after_topk: bool = False  # Moe.softmax_after_topk
    clamped_swiglu: bool = False  # Moe.clamped_swiglu, from config.json's swiglu_alpha and swiglu_limit
    group_limited: bool = False  # Moe.group_limited (DeepSeek-V3), its layers from first_k_dense_replace on


# the checkpoint names of the norms that sit after a sublayer instead of before the next one
_POST_NORM_NAMES = {"post_attention_layernorm.weight": "attn_out_norm",
                    "post_feedforward_layernorm.weight": "mlp_out_norm"}
_GEMMA_NAMES = {**_POST_NORM_NAMES, "pre_feedforward_layernorm.weight": "mlp_norm"}


@dataclass(frozen=True)
class GgufRules:
    """How llama.cpp's converter writes a family to GGUF, and what llama.cpp assumes of it where the
    file is silent (the numbers the converter does write are read by ``gguf_config`` wherever they
    appear: Granite's scales, Gemma's soft-caps, a sliding window, expert counts)."""

    arch: str  # general.architecture
    # q/k rows permuted for ggml's interleaved rotary (the converter's LlamaModel and its subclasses)
    permuted_qk: bool = False
    names: dict[str, str] = field(default_factory=dict)  # tensor names that mean another tensor here
    # which layers ``attention.sliding_window`` windows when no ``sliding_window_pattern`` lists them, as
    # llama.cpp's period: all but every window_period-th (Gemma 2: 2, Gemma 3: 6), 0: every layer (Phi-3, as
    # transformers runs it: llama.cpp turns Phi-3's window off), None: no layer (as llama.cpp runs Llama, Qwen)
    window_period: int | None = None
    nope_period: int | None = None  # every nope_period-th layer does not rotate (SmolLM3: 4)
    # the layer counts of the sizes whose softmax scale is (hidden / heads) ** -0.5, not head_dim ** -0.5
    # (the 27Bs of Gemma 2: 46, and Gemma 3: 62); the converter writes no scale for Gemma
    scale_by_hidden_layers: tuple[int, ...] = ()
    local_rope_theta: float = 10000.0  # the local layers' rope base (Family.local_rope): not in the file
    activation: str = "silu"  # the gated MLP's (Gemma: gelu_tanh)
    renormalize_experts: bool = True  # without ``expert_weights_norm`` in the file (llama.cpp: always)


# Phi-3's ffn_up holds gate and up fused, [2 x intermediate, hidden]
_PHI3_GGUF_NAMES = {"ffn_up.weight": "gate_up"}
# gpt-oss's o_proj bias, sinks, router and experts, each projection of every expert in one tensor
# (``Family.stacked_experts``)
_GPT_OSS_NAMES = {"self_attn.o_proj.bias": "o_bias", "self_attn.sinks": "sinks",
                  "mlp.router.weight": "router", "mlp.router.bias": "router_bias",
                  "mlp.experts.gate_up_proj": "experts_gate_up",
                  "mlp.experts.gate_up_proj_bias": "experts_gate_up_bias",
                  "mlp.experts.down_proj": "experts_down", "mlp.experts.down_proj_bias": "experts_down_bias"}
# DeepSeek-V3's latent attention (``Mla``), its router's correction bias and its shared experts
_DEEPSEEK_NAMES = {"self_attn.q_a_proj.weight": "q_a", "self_attn.q_a_layernorm.weight": "q_a_norm",
                   "self_attn.q_b_proj.weight": "q_b", "self_attn.kv_a_proj_with_mqa.weight": "kv_a",
                   "self_attn.kv_a_layernorm.weight": "kv_a_norm", "self_attn.kv_b_proj.weight": "kv_b",
                   "mlp.gate.e_score_correction_bias": "router_correction",
                   "mlp.shared_experts.gate_proj.weight": "shared_gate",
                   "mlp.shared_experts.up_proj.weight": "shared_up",
                   "mlp.shared_experts.down_proj.weight": "shared_down"}


@dataclass(frozen=True)
class Family:
    """What a model family changes from the Llama decoder layer (``FAMILIES``, by HF model_type).

    The loader maps every family's tensor names at once (they do not clash: Phi-3 stores the fused
    ``qkv_proj`` and ``gate_up_proj`` that the model fuses for the others), except the few that
    ``hf_names`` gives another meaning; the rest is here. Numbers a family's config.json carries
    (Granite's multipliers, Gemma's soft-caps and ``query_pre_attn_scalar``) are read by
    ``ModelConfig.from_hf`` wherever they appear."""

    attention_bias: bool = False  # a bias on the q/k/v projections (Qwen2), unless config.json says
    # RMSNorm of q and of k before rotary: "head" over each head (weights [D]: Qwen3, Gemma 3),
    # "whole" over all of q and all of k (weights [H * D]: OLMo 2)
    qk_norm: str | None = None
    pre_norms: bool = True  # RMSNorm before attention and before the MLP (all but OLMo 2)
    # RMSNorm of attention's and the MLP's outputs, before the residual add (OLMo 2, Gemma 2 and 3)
    post_norms: bool = False
    # every RMSNorm scales by (offset + weight): Gemma's 1 + weight (its GGUF stores 1 + weight, which
    # the loader takes the offset off again)
    norm_offset: float = 0.0
    embed_scale_sqrt: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    local_rope: bool = False  # sliding-window layers rotate with their own base (Gemma 3)
    # which layers config.json's ``sliding_window`` windows (``_hf_window``): "all" (Mistral, Phi-3, Mixtral,
    # Qwen3-MoE: every layer, whenever it is set), "types" (the layers ``layer_types`` names
    # sliding_attention, or the family's own rule without it: Qwen2, Qwen3, SmolLM3, Gemma 2 and 3), None: no layer
    window_layers: str | None = None
    nope_layers: bool = False  # layers without rotary, from no_rope_layers (SmolLM3)
    moe: MoeNames | None = None  # experts in place of the MLP (Mixtral, Qwen3-MoE, gpt-oss)
    # every expert's projection in one checkpoint tensor [E, in, out] (x @ w), gate_up's gate and up columns
    # interleaved (gpt-oss): the loader turns them into MoeBlock's [E, out, in], gate rows then up rows
    stacked_experts: bool = False
    # a learned logit per head that joins each query's softmax as one more key without a value (gpt-oss)
    attention_sinks: bool = False
    mla: bool = False  # multi-head latent attention (DeepSeek-V3: ``Mla``), the pool holding its latent
    hf_names: dict[str, str] = field(default_factory=dict)  # checkpoint names that mean another tensor here
    gguf: GgufRules | None = None  # None: no GGUF of the family is read


FAMILIES = {
    "llama": Family(gguf=GgufRules("llama", permuted_qk=True)),
    "mistral": Family(window_layers="all", gguf=GgufRules("mistral", permuted_qk=True)),
    "qwen2": Family(attention_bias=True, window_layers="types", gguf=GgufRules("qwen2")),
    "qwen3": Family(qk_norm="head", window_layers="types", gguf=GgufRules("qwen3")),
    "phi3": Family(window_layers="all", gguf=GgufRules("phi3", names=_PHI3_GGUF_NAMES, window_period=0)),
    "olmo2": Family(qk_norm="whole", pre_norms=False, post_norms=True, hf_names=_POST_NORM_NAMES,
                    gguf=GgufRules("olmo2")),
    # embedding, residual, attention and logits multipliers: all in config.json (and the GGUF's *_scale keys)
    "granite": Family(gguf=GgufRules("granite", permuted_qk=True)),
    "gemma2": Family(post_norms=True, norm_offset=1.0, embed_scale_sqrt=True, window_layers="types",
                     hf_names=_GEMMA_NAMES,
                     gguf=GgufRules("gemma2", window_period=2, scale_by_hidden_layers=(46,), activation="gelu_tanh")),
    "gemma3_text": Family(qk_norm="head", post_norms=True, norm_offset=1.0, embed_scale_sqrt=True,
                          local_rope=True, window_layers="types", hf_names=_GEMMA_NAMES,
                          gguf=GgufRules("gemma3", window_period=6, scale_by_hidden_layers=(62,),
                                         activation="gelu_tanh")),
    "smollm3": Family(nope_layers=True, window_layers="types", gguf=GgufRules("smollm3", permuted_qk=True,
                                                                            nope_period=4)),
    # the converter writes Mixtral as a Llama with expert tensors
    "mixtral": Family(window_layers="all", moe=MoeNames("intermediate_size", True, round_weights=False),
                      gguf=GgufRules("llama", permuted_qk=True)),
    "qwen3_moe": Family(qk_norm="head", window_layers="all",
                        moe=MoeNames("moe_intermediate_size", None, round_weights=True), gguf=GgufRules("qwen3moe")),
    # q/k/v/o biases (attention_bias), sinks, windowed and global layers (layer_types), YaRN (rope_parameters),
    # every layer's experts with biases; no GGUF: llama.cpp's "gpt-oss" keeps its experts in MXFP4
    "gpt_oss": Family(attention_bias=True, window_layers="types", attention_sinks=True, stacked_experts=True,
                      moe=MoeNames("intermediate_size", False, round_weights=True, softmax_after_topk=True,
                                   clamped_swiglu=True), hf_names=_GPT_OSS_NAMES),
    # latent attention, dense layers then experts with a group-limited sigmoid router and shared experts; no GGUF
    "deepseek_v3": Family(mla=True, moe=MoeNames("moe_intermediate_size", None, round_weights=False,
                                                 group_limited=True), hf_names=_DEEPSEEK_NAMES),
}
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF's name -> the model's


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a key of FAMILIES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: str | None = None  # Family.qk_norm: "head" (Qwen3, Gemma 3), "whole" (OLMo 2)
    pre_norms: bool = True  # Family.pre_norms
    post_norms: bool = False  # Family.post_norms
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh" (Gemma)
    embedding_multiplier: float = 1.0  # Granite's embedding_multiplier, Gemma's sqrt(hidden)
    residual_multiplier: float = 1.0  # Granite: each sublayer's output scaled before the residual add
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores become cap * tanh(scores / cap)
    logits_scaling: float = 1.0  # Granite: the logits divided by it
    final_softcap: float | None = None  # Gemma 2: logits become cap * tanh(logits / cap)
    # Gemma 3: the rope base of the sliding-window layers (``local_layers``); the others use rope_theta
    local_rope_theta: float | None = None
    local_layers: tuple[int, ...] = ()
    nope_layers: tuple[int, ...] = ()  # SmolLM3: the layers that do not rotate q and k
    moe: Moe | None = None  # Mixtral, Qwen3-MoE, gpt-oss
    attention_sinks: bool = False  # Family.attention_sinks: each layer's ``sinks`` weights [Hq]
    # the sliding window of the layers in ``window_layers`` (the others see the whole context): the query at
    # position p sees the keys in (p - sliding_window, p], as transformers' sliding_window_overlay
    sliding_window: int | None = None
    window_layers: tuple[int, ...] = ()
    rope_scaling: RopeScaling | YarnScaling | None = None
    # explicit per-frequency divisors (GGUF stores Llama-3 scaling as a `rope_freqs` tensor)
    rope_freq_factors: tuple[float, ...] | None = field(default=None, repr=False)
    # DeepSeek's latent attention: then num_kv_heads (1) and head_dim (latent_size / 2) describe the pool's
    # slot of a token, not attention heads (``shared.model.mla``), and attention_scale is always set
    mla: Mla | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.window_layers and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"window_layers {self.window_layers} need a positive sliding_window, "
                             f"not {self.sliding_window}")

    @property
    def uniform_window(self) -> int | None:
        """The sliding window when every layer has it (blocks out of it can be freed), else None."""
        return self.sliding_window if set(self.window_layers) == set(range(self.num_layers)) else None

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer ``index``; None where it sees the whole context."""
        return self.sliding_window if index in self.window_layers else None

    @property
    def rotary_dim(self) -> int:
        """The channels rotary turns in each head: all of it, or MLA's rope part."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.mla is not None:
            attn = _mla_params(self.mla, self.hidden_size, self.num_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        total = self.num_layers * (attn + mlp + 2 * self.hidden_size) + embed + self.hidden_size
        if self.moe is not None:  # every expert and the router, in place of the dense MLP
            experts = self.moe.num_experts * (3 * self.moe.intermediate_size + 1) * self.hidden_size
            if self.moe.group_limited is not None:
                experts += 3 * self.moe.group_limited.num_shared_experts * self.moe.intermediate_size * self.hidden_size
            total += len(self.moe.layers) * (experts - mlp)
        return total

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        family = FAMILIES.get(model_type, Family())  # the loader refuses a model_type it does not know
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")  # Gemma names it hidden_activation
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r} of {model_type} (supported: {', '.join(ACTIVATIONS)})")
        if cfg.get("mlp_bias"):
            raise ValueError(f"unsupported mlp_bias of {model_type} (MLPs without biases only)")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"unsupported use_bidirectional_attention of {model_type} (causal attention only)")
        max_positions = int(cfg.get("max_position_embeddings", 4096))
        scalar = cfg.get("query_pre_attn_scalar")  # Gemma's softmax scale; Granite's attention_multiplier
        attention_scale = float(scalar) ** -0.5 if scalar else cfg.get("attention_multiplier")
        rotary_dim = int(cfg["qk_rope_head_dim"]) if family.mla else head_dim
        model = cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family.attention_bias)),
            qk_norm=family.qk_norm,
            pre_norms=family.pre_norms,
            post_norms=family.post_norms,
            activation=ACTIVATIONS[act],
            embedding_multiplier=(float(cfg["hidden_size"]) ** 0.5 if family.embed_scale_sqrt
                                  else float(cfg.get("embedding_multiplier", 1.0))),
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
            attention_scale=None if attention_scale is None else float(attention_scale),
            attn_softcap=_optional_float(cfg.get("attn_logit_softcapping")),
            logits_scaling=float(cfg.get("logits_scaling", 1.0)),
            final_softcap=_optional_float(cfg.get("final_logit_softcapping")),
            nope_layers=_hf_nope_layers(cfg) if family.nope_layers else (),
            moe=_hf_moe(cfg, family.moe) if family.moe else None,
            attention_sinks=family.attention_sinks,
            **_hf_window(cfg, family),
            **_hf_rope(cfg, family, model_type, rotary_dim),
        )
        return dataclasses.replace(model, **_hf_mla(cfg, model)) if family.mla else model


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _mla_params(mla: Mla, hidden: int, heads: int) -> int:
    q = hidden * heads * mla.qk_head_dim if mla.q_lora_rank is None else (
        mla.q_lora_rank * (hidden + 1 + heads * mla.qk_head_dim))
    kv = hidden * mla.latent_size + mla.kv_lora_rank * (1 + heads * (mla.qk_nope_head_dim + mla.v_head_dim))
    return q + kv + heads * mla.v_head_dim * hidden


def _hf_mla(cfg: dict[str, Any], model: ModelConfig) -> dict[str, Any]:
    """The fields a DeepSeek config.json's latent attention sets (``Mla``): the pool's slot of a token as one
    "KV head" of latent_size / 2 channels a plane (the latent split across the K and V planes), and the
    softmax scale qk_head_dim^-1/2, times YaRN's mscale(factor, mscale_all_dim)^2 as transformers applies it."""
    mla = Mla(q_lora_rank=_optional_int(cfg.get("q_lora_rank")), kv_lora_rank=int(cfg["kv_lora_rank"]),
              qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
              v_head_dim=int(cfg["v_head_dim"]), rope_interleave=bool(cfg.get("rope_interleave", True)))
    if cfg.get("attention_bias"):
        raise ValueError(f"unsupported attention_bias of {model.architecture} (latent attention without biases only)")
    if mla.latent_size % 2:
        raise ValueError(f"unsupported kv_lora_rank + qk_rope_head_dim = {mla.latent_size} of {model.architecture}: "
                         f"the latent is split over the pool's K and V planes, so it must be even")
    scale = mla.qk_head_dim ** -0.5
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default" and params.get("mscale_all_dim"):
        if not isinstance(model.rope_scaling, YarnScaling):
            raise ValueError(f"unsupported mscale_all_dim of a {kind!r} rope scaling of {model.architecture} "
                             f"(YaRN's only)")
        factor = model.rope_scaling.factor
        mscale = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return dict(mla=mla, num_kv_heads=1, head_dim=mla.latent_size // 2, attention_scale=scale)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _hf_nope_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without rotary: ``no_rope_layers`` holds 1 for a layer that rotates, 0 for one
    that does not; without it, every ``no_rope_layer_interval``-th layer does not."""
    num_layers = cfg["num_hidden_layers"]
    uses_rope = cfg.get("no_rope_layers")
    if uses_rope is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        uses_rope = [(i + 1) % interval != 0 for i in range(num_layers)]
    return tuple(i for i in range(num_layers) if not uses_rope[i])


# the families whose transformers config has a use_sliding_window switch, off unless config.json turns it on
_WINDOW_SWITCH_OFF = ("qwen2", "qwen3", "qwen3_moe", "smollm3")


def _hf_window(cfg: dict[str, Any], family: Family) -> dict[str, Any]:
    """``sliding_window`` and ``window_layers`` as transformers 5 decides them for the family
    (``Family.window_layers``): no window unless config.json sets ``sliding_window`` (and
    ``use_sliding_window``, where the family has that switch). Without ``layer_types``, the family's
    own rule: Qwen2 and Qwen3 window the layers from ``max_window_layers`` on, SmolLM3 its layers
    without rotary, Gemma 2 every other layer from the first, Gemma 3 all but every
    ``sliding_window_pattern``-th."""
    switched_on = cfg.get("use_sliding_window", cfg.get("model_type") not in _WINDOW_SWITCH_OFF)
    window = cfg.get("sliding_window") if switched_on else None
    if family.window_layers is None or not window:
        return dict(sliding_window=None, window_layers=())
    num_layers = cfg["num_hidden_layers"]
    if family.window_layers == "all":
        return dict(sliding_window=int(window), window_layers=tuple(range(num_layers)))
    types = cfg.get("layer_types") or _default_layer_types(cfg)
    layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    return dict(sliding_window=int(window) if layers else None, window_layers=layers)


def _default_layer_types(cfg: dict[str, Any]) -> list[str]:
    """A config.json without ``layer_types``: the layer types its family's transformers config derives."""
    model_type, num_layers = cfg.get("model_type"), cfg["num_hidden_layers"]
    if model_type in ("qwen2", "qwen3"):
        is_windowed = [i >= int(cfg.get("max_window_layers", 28)) for i in range(num_layers)]
    elif model_type == "smollm3":
        is_windowed = [i in _hf_nope_layers(cfg) for i in range(num_layers)]
    else:  # Gemma 2, gpt-oss: every other layer (no pattern field); Gemma 3: configs from before layer_types
        pattern = 2 if model_type in ("gemma2", "gpt_oss") else int(cfg.get("sliding_window_pattern", 6))
        is_windowed = [(i + 1) % pattern != 0 for i in range(num_layers)]
    return ["sliding_attention" if w else "full_attention" for w in is_windowed]


def _hf_moe(cfg: dict[str, Any], names: MoeNames) -> Moe:
    """The experts of a Mixtral or Qwen3-MoE config.json. Qwen3-MoE keeps the dense MLP in
    ``mlp_only_layers`` and in the layers that ``decoder_sparse_step`` skips. Mixtral counts its experts
    in num_local_experts, Qwen3-MoE in num_experts (transformers 5 writes num_local_experts for both)."""
    key = next(k for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in cfg)
    num_experts = int(cfg[key] or 0)
    step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
    first = int(cfg.get("first_k_dense_replace") or 0)  # DeepSeek: dense layers before the experts'
    layers = tuple(i for i in range(cfg["num_hidden_layers"])
                   if num_experts > 0 and i not in dense and (i + 1) % step == 0 and i >= first)
    renormalize = names.renormalize if names.renormalize is not None else bool(cfg.get("norm_topk_prob", False))
    swiglu = (ClampedSwiglu(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)))
              if names.clamped_swiglu else None)
    grouped = _hf_group_limited(cfg, num_experts) if names.group_limited else None
    return Moe(num_experts=num_experts, top_k=int(cfg["num_experts_per_tok"]),
               intermediate_size=int(cfg[names.width]), renormalize=renormalize,
               round_weights=names.round_weights, layers=layers, softmax_after_topk=names.softmax_after_topk,
               clamped_swiglu=swiglu, group_limited=grouped)


def _hf_group_limited(cfg: dict[str, Any], num_experts: int) -> GroupLimitedRouting:
    """DeepSeek-V3's router and shared experts; groups that do not hold two experts each are refused (a
    group's worth is its two best scores, as transformers takes them)."""
    groups, topk_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if num_experts % groups or num_experts // groups < 2 or topk_groups > groups:
        raise ValueError(f"unsupported expert groups of {cfg.get('model_type')}: {num_experts} experts in n_group "
                         f"{groups} (two or more each), topk_group {topk_groups}")
    return GroupLimitedRouting(num_groups=groups, topk_groups=topk_groups,
                               routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                               num_shared_experts=int(cfg.get("n_shared_experts") or 0))


def _hf_rope(cfg: dict[str, Any], family: Family, model_type: str, head_dim: int) -> dict[str, Any]:
    """``ModelConfig``'s rope fields from a config.json: transformers < 5 writes rope_theta and
    rope_scaling, >= 5 one rope_parameters dict (Gemma 3: one per layer type)."""
    params = cfg.get("rope_parameters") or {}
    local_params = params.get("sliding_attention") if family.local_rope else None
    params = params.get("full_attention", params) if family.local_rope else params
    scaling = cfg.get("rope_scaling") or params or None
    rope, rope_kind = None, (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    freq_factors = None
    if rope_kind == "llama3":
        rope = RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    elif rope_kind == "linear":  # positions divided by the factor: every frequency divided by it
        freq_factors = (float(scaling["factor"]),) * (head_dim // 2)
    elif rope_kind == "yarn":
        rope = _hf_yarn(scaling, int(cfg.get("max_position_embeddings", 4096)))
    elif rope_kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {rope_kind!r} of {model_type} (supported: default, llama3, "
                         f"linear, yarn): {scaling!r}")
    partial = (scaling or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {partial} of {model_type} (rotary over the "
                         f"whole head only)")
    local_theta, local_layers = None, ()
    if family.local_rope:  # Gemma 3: the sliding-window layers' own base, never scaled
        local_theta = float((local_params or {}).get("rope_theta") or cfg.get("rope_local_base_freq", 10000.0))
        types = cfg.get("layer_types") or _default_layer_types(cfg)
        local_layers = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    return dict(rope_theta=float(cfg.get("rope_theta") or params.get("rope_theta", 10000.0)), rope_scaling=rope,
                rope_freq_factors=freq_factors, local_rope_theta=local_theta, local_layers=local_layers)


def _hf_yarn(scaling: dict[str, Any], max_positions: int) -> YarnScaling:
    """YaRN's fields as transformers reads them: without a factor, the context's growth over the original;
    beta_fast and beta_slow 32 and 1 where missing (or 0); truncate unless it says not to."""
    original = int(scaling["original_max_position_embeddings"])
    return YarnScaling(factor=float(scaling.get("factor") or max_positions / original),
                       original_max_position_embeddings=original,
                       beta_fast=float(scaling.get("beta_fast") or 32.0),
                       beta_slow=float(scaling.get("beta_slow") or 1.0),
                       truncate=bool(scaling.get("truncate", True)),
                       attention_factor=_optional_float(scaling.get("attention_factor")),
                       mscale=_optional_float(scaling.get("mscale")),
                       mscale_all_dim=_optional_float(scaling.get("mscale_all_dim")))
