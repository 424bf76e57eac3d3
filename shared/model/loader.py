"""Weight loaders: GGUF (via the ``gguf`` package) and Hugging Face directories (safetensors).

Both produce canonical tensor names (``embed``, ``norm``, ``lm_head``, ``layers.{i}.{name}``) in
the HF orientation ([out_features, in_features]) and the Q/K row order HF uses; the model fuses
them. Progress bars go to stderr.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from shared.model.config import ModelConfig
from shared.model.llama import LlamaModel

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k",
    "attn_v.weight": "v", "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias",
    "attn_output.weight": "o_proj", "ffn_norm.weight": "mlp_norm", "ffn_gate.weight": "gate",
    "ffn_up.weight": "up", "ffn_down.weight": "down",
}
_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v", "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias", "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.weight": "o_proj", "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")

    def get(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = int(get("attention.key_length") or hidden // num_heads)
    names = {t.name for t in reader.tensors}
    rope = None
    if get("rope.scaling.type") == "llama3" or get("rope.scaling.factor"):
        factor = float(get("rope.scaling.factor", 1.0))
        if factor != 1.0 and "rope_freqs.weight" not in names:
            raise ValueError(f"GGUF rope scaling {get('rope.scaling.type')!r} without rope_freqs is unsupported")
    freq_factors = None
    if "rope_freqs.weight" in names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        freq_factors = tuple(float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_scaling=rope,
        rope_freq_factors=freq_factors,
    )


def _unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (its interleaved RoPE → HF's rotate-half order)."""
    out = w.shape[0]
    return w.reshape(num_heads, out // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(tensor) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        arr = np.asarray(tensor.data)
    else:
        arr = quants.dequantize(tensor.data, tensor.tensor_type)
    arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantize every tensor of a GGUF file (F32/F16/BF16/Q8_0/Q4_0/Q4_1/K-quants via gguf)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    cfg = gguf_config(reader)
    tensors: dict[str, torch.Tensor] = {}
    permute = cfg.architecture in ("llama", "mistral")
    for t in tqdm(reader.tensors, desc=f"loading {Path(path).name}", unit="tensor", leave=False):
        if t.name == "rope_freqs.weight":
            continue
        w = _dequantize(t)
        if t.name == "token_embd.weight":
            tensors["embed"] = w
        elif t.name == "output_norm.weight":
            tensors["norm"] = w
        elif t.name == "output.weight":
            tensors["lm_head"] = w
        elif t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            name = _GGUF_LAYER_NAMES.get(rest)
            if name is None:
                log.warning("ignoring unknown GGUF tensor %s", t.name)
                continue
            if permute and name in ("q", "k", "q_bias", "k_bias"):
                heads = cfg.num_heads if name.startswith("q") else cfg.num_kv_heads
                w = _unpermute_qk(w, heads)
            tensors[f"layers.{idx}.{name}"] = w
        else:
            log.warning("ignoring unknown GGUF tensor %s", t.name)
    return cfg, tensors


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    path = Path(path)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    if cfg.architecture not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported model_type {cfg.architecture!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in tqdm(files, desc=f"loading {path.name}", unit="file", leave=False):
        for name, w in load_file(str(f)).items():
            if name == "model.embed_tokens.weight":
                tensors["embed"] = w
            elif name == "model.norm.weight":
                tensors["norm"] = w
            elif name == "lm_head.weight":
                tensors["lm_head"] = w
            elif name.startswith("model.layers."):
                idx, rest = name[len("model.layers."):].split(".", 1)
                if rest in _HF_LAYER_NAMES:
                    tensors[f"layers.{idx}.{_HF_LAYER_NAMES[rest]}"] = w
                elif not rest.endswith("rotary_emb.inv_freq"):
                    log.warning("ignoring unknown tensor %s", name)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head", None)
    return cfg, tensors


def build_model(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> LlamaModel:
    def take(name: str) -> torch.Tensor:
        try:
            return tensors.pop(name).to(device=device, dtype=dtype)
        except KeyError:
            raise ValueError(f"model weights are missing tensor {name!r}") from None

    top = {"embed": take("embed"), "norm": take("norm")}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = take("lm_head")
    layers = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w = {
            "attn_norm": take(p + "attn_norm"),
            "qkv": torch.cat([take(p + "q"), take(p + "k"), take(p + "v")]),
            "o_proj": take(p + "o_proj"),
            "mlp_norm": take(p + "mlp_norm"),
            "gate_up": torch.cat([take(p + "gate"), take(p + "up")]),
            "down": take(p + "down"),
        }
        if cfg.attention_bias:
            w["qkv_bias"] = torch.cat([take(p + "q_bias"), take(p + "k_bias"), take(p + "v_bias")])
        layers.append(w)
    return LlamaModel(cfg, top, layers)


def load_model(path: Path, fmt: str, device: torch.device, dtype: torch.dtype) -> LlamaModel:
    """Load a model from a GGUF file (``fmt="gguf"``) or an HF directory (``fmt="hf"``)."""
    cfg, tensors = load_gguf(path) if fmt == "gguf" else load_hf_dir(path)
    return build_model(cfg, tensors, device, dtype)
