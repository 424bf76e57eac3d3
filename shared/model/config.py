"""Model shape and hyper-parameters, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

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
class Family:
    """What a model family changes from the Llama decoder layer (``FAMILIES``, by HF model_type).

    The loader maps every family's tensor names at once (they do not clash: Phi-3 stores the fused
    ``qkv_proj`` and ``gate_up_proj`` that the model fuses for the others); the rest is here."""

    attention_bias: bool = False  # a bias on the q/k/v projections (Qwen2), unless config.json says
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before rotary (Qwen3)
    # attention past ``sliding_window`` tokens is not implemented: the context is cut to the window
    context_within_window: bool = False


FAMILIES = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(attention_bias=True),
    "qwen3": Family(qk_norm=True, context_within_window=True),
    "phi3": Family(context_within_window=True),
}


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
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary
    rope_scaling: RopeScaling | None = None
    # explicit per-frequency divisors (GGUF stores Llama-3 scaling as a `rope_freqs` tensor)
    rope_freq_factors: tuple[float, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * self.hidden_size) + embed + self.hidden_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers < 5 writes rope_theta + rope_scaling; >= 5 one rope_parameters dict
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
        rope = None
        if scaling and (scaling.get("rope_type") or scaling.get("type")) == "llama3":
            rope = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
        elif scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
            kind = scaling.get("rope_type") or scaling.get("type")
            raise ValueError(f"unsupported rope scaling {kind!r} of {model_type} (supported: default, llama3): "
                             f"{scaling!r}")
        partial = (scaling or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if float(partial) != 1.0:
            raise ValueError(f"unsupported partial_rotary_factor {partial} of {model_type} (rotary over the "
                             f"whole head only)")
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} of {model_type} (SwiGLU's silu only)")
        rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        family = FAMILIES.get(model_type, Family())  # the loader refuses a model_type it does not know
        max_positions = int(cfg.get("max_position_embeddings", 4096))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if family.context_within_window and window:
            max_positions = min(max_positions, int(window))
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family.attention_bias)),
            qk_norm=family.qk_norm,
            rope_scaling=rope,
        )
