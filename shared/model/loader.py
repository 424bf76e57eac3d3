"""Weight loaders: GGUF (``shared/model/gguf_file.py`` reads it, the ``gguf`` package dequantizes)
and Hugging Face directories (safetensors).

Both produce canonical tensor names (``embed``, ``norm``, ``lm_head``, ``layers.{i}.{name}``) in
the HF orientation ([out_features, in_features]) and the Q/K row order HF uses; the model fuses
them. Each tensor is converted to the model's device and dtype as soon as it is read, so loading
holds the model in its final precision plus one tensor in float32, never a float32 copy of all
(a 1.07B-parameter Q8_0 GGUF loaded as bfloat16: 5.5 GiB peak RSS when every tensor was
dequantized first, 3.6 GiB now: the 2.0 GiB model, the file's mapped pages, one float32 tensor).
Progress bars go to stderr.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from shared.model.config import FAMILIES, Family, GgufRules, ModelConfig, Moe
from shared.model.gguf_file import GgufFile, GgufTensor, read_gguf
from shared.model.llama import LAYERWISE_QUANTIZATIONS, LlamaModel
from shared.model.parallel import Collectives, PipelineStage, check_tensor_parallel, shard_layer, shard_top

log = logging.getLogger(__name__)

# from a Hugging Face directory (its model_type), and from a GGUF file (its general.architecture, as
# llama.cpp's converter names it: ``GgufRules.arch``; Mixtral is a "llama" with expert tensors)
SUPPORTED_HF_ARCHS = tuple(FAMILIES)
SUPPORTED_ARCHS = tuple(dict.fromkeys(f.gguf.arch for f in FAMILIES.values() if f.gguf is not None))
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k",
    "attn_v.weight": "v", "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias",
    "attn_output.weight": "o_proj", "ffn_norm.weight": "mlp_norm", "ffn_gate.weight": "gate",
    "ffn_up.weight": "up", "ffn_down.weight": "down",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",  # Qwen3, OLMo 2, Gemma 3
    "attn_qkv.weight": "qkv",  # Phi-3: fused
    "post_attention_norm.weight": "attn_out_norm", "post_ffw_norm.weight": "mlp_out_norm",  # OLMo 2, Gemma
    "ffn_gate_inp.weight": "router",  # Mixtral, Qwen3-MoE
    # every expert's projection in one tensor [E, out, in]: read as one tensor per expert
    "ffn_gate_exps.weight": "experts.gate", "ffn_up_exps.weight": "experts.up",
    "ffn_down_exps.weight": "experts.down",
}
_GGUF_TOP_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k", "self_attn.v_proj.weight": "v", "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias", "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.weight": "o_proj", "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",  # Qwen3, OLMo 2, Gemma 3
    "self_attn.qkv_proj.weight": "qkv", "mlp.gate_up_proj.weight": "gate_up",  # Phi-3: fused already
    "block_sparse_moe.gate.weight": "router", "mlp.gate.weight": "router",  # Mixtral, Qwen3-MoE
}
# an expert's projections, after ``<block>.experts.<e>.`` (Mixtral's w1/w3/w2, Qwen3-MoE's)
_HF_EXPERT_NAMES = {"w1.weight": "gate", "w3.weight": "up", "w2.weight": "down",
                    "gate_proj.weight": "gate", "up_proj.weight": "up", "down_proj.weight": "down"}
_HF_TOP_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}


def gguf_family(reader: GgufFile) -> str:
    """The key of ``FAMILIES`` a GGUF file is of: its architecture's family, the one with experts where
    the file has expert tensors (Mixtral, written as a Llama)."""
    arch = reader.get("general.architecture")
    kinds = [k for k, f in FAMILIES.items() if f.gguf is not None and f.gguf.arch == arch]
    if not kinds:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    has_experts = any(t.name.endswith(".ffn_gate_inp.weight") for t in reader.tensors)
    return next((k for k in kinds if (FAMILIES[k].moe is not None) == has_experts), kinds[0])


def gguf_config(reader: GgufFile) -> ModelConfig:
    """The model's config from a GGUF file's metadata, with what llama.cpp assumes of the family where
    the file is silent (``GgufRules``)."""
    model_type = gguf_family(reader)
    family = FAMILIES[model_type]
    rules = family.gguf

    def get(key, default=None):
        return reader.get(f"{rules.arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    num_layers = int(get("block_count"))
    vocab = get("vocab_size") or len(reader.get("tokenizer.ggml.tokens", ())) or tensors["token_embd.weight"].shape[0]
    head_dim = int(get("attention.key_length") or hidden // num_heads)
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ValueError(f"unsupported GGUF rope.dimension_count {rope_dims} of {model_type} (rotary over the "
                         f"whole head of {head_dim} only)")
    if "rope_factors_long.weight" in tensors:
        raise ValueError(f"unsupported GGUF long-context rope factors of {model_type} (Phi-3's longrope)")
    window, window_layers = _gguf_window(get, rules, num_layers)
    scale = get("attention.scale")
    if scale is None and rules.scale_by_hidden_layers:
        scale = float(hidden // num_heads if num_layers in rules.scale_by_hidden_layers else head_dim) ** -0.5
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm=family.qk_norm,
        pre_norms=family.pre_norms,
        post_norms=family.post_norms,
        activation=rules.activation,
        embedding_multiplier=float(hidden) ** 0.5 if family.embed_scale_sqrt else float(get("embedding_scale", 1.0)),
        residual_multiplier=float(get("residual_scale", 1.0)),
        attention_scale=None if scale is None else float(scale),
        attn_softcap=_optional_float(get("attn_logit_softcapping")),
        logits_scaling=float(get("logit_scale", 1.0)),  # Granite's: the logits divided by it
        final_softcap=_optional_float(get("final_logit_softcapping")),
        local_rope_theta=float(get("rope.freq_base_swa", rules.local_rope_theta)) if family.local_rope else None,
        local_layers=window_layers if family.local_rope else (),  # llama.cpp: the windowed layers
        nope_layers=tuple(i for i in range(num_layers) if rules.nope_period and (i + 1) % rules.nope_period == 0),
        moe=_gguf_moe(get, family, tensors, num_layers) if family.moe is not None else None,
        sliding_window=window,
        window_layers=window_layers,
        rope_scaling=None,
        rope_freq_factors=_gguf_rope_freq_factors(get, tensors, model_type, head_dim),
    )


def _optional_float(value) -> float | None:
    """A soft-cap: None where the file has none (or 0)."""
    return float(value) if value else None


def _gguf_rope_freq_factors(get, tensors: dict[str, GgufTensor], model_type: str,
                            head_dim: int) -> tuple[float, ...] | None:
    """Llama 3's scaling as the file's ``rope_freqs`` divisors; a ``linear`` scaling (Gemma 3's global
    layers) as its factor for every frequency."""
    kind, factor = get("rope.scaling.type"), float(get("rope.scaling.factor") or 1.0)
    if "rope_freqs.weight" in tensors:
        return tuple(float(x) for x in np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).reshape(-1))
    if kind == "linear" and factor != 1.0:
        return (factor,) * (head_dim // 2)
    if factor != 1.0:
        raise ValueError(f"unsupported GGUF rope scaling {kind!r} (factor {factor}) of {model_type} (supported: "
                         f"linear, and Llama 3's as a rope_freqs tensor)")
    return None


def _gguf_window(get, rules: GgufRules, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """``attention.sliding_window`` and the layers it windows: those ``attention.sliding_window_pattern``
    marks (a flag per layer, or a period), else the family's period (``GgufRules.window_period``); a
    family without one is read without a window (as llama.cpp runs Llama and Qwen)."""
    window = int(get("attention.sliding_window") or 0)
    pattern = get("attention.sliding_window_pattern", rules.window_period)
    if window <= 0 or pattern is None:
        return None, ()
    if isinstance(pattern, list):
        layers = tuple(i for i, windowed in enumerate(pattern) if windowed)
    else:  # llama.cpp's period: all but every period-th layer; 0: every layer
        period = int(pattern)
        layers = tuple(i for i in range(num_layers) if period == 0 or (i + 1) % period != 0)
    return (window, layers) if layers else (None, ())


def _gguf_moe(get, family: Family, tensors: dict[str, GgufTensor], num_layers: int) -> Moe:
    """The experts of a GGUF file: in the layers that have a router (``ffn_gate_inp``); renormalised as
    ``expert_weights_norm`` says, else as llama.cpp does for the family."""
    gating = get("expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ValueError(f"unsupported GGUF expert_gating_func {gating} (softmax only)")
    if get("expert_shared_count"):
        raise ValueError(f"unsupported GGUF expert_shared_count {get('expert_shared_count')} (no shared experts)")
    norm = get("expert_weights_norm")
    return Moe(num_experts=int(get("expert_count")), top_k=int(get("expert_used_count")),
               intermediate_size=int(get("expert_feed_forward_length") or get("feed_forward_length")),
               renormalize=bool(norm) if norm is not None else family.gguf.renormalize_experts,
               round_weights=family.moe.round_weights,
               layers=tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors))


def _unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (its interleaved RoPE → HF's rotate-half order)."""
    out = w.shape[0]
    return w.reshape(num_heads, out // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ggml block formats dequantized here with torch (32 values a block; d, m: float16 scale and min):
# Q8_0 = d, 32 x int8 (x = d*q); Q4_0 = d, 16 bytes of nibbles (x = d*(q-8)); Q4_1 = d, m, nibbles
# (x = d*q + m). A byte's low nibble is value j, its high nibble value j+16 of the block. The
# gguf package's numpy versions give the same floats 3x slower; it dequantizes the other formats.
_Q8_0, _Q4_0, _Q4_1 = 8, 2, 3
_TORCH_BLOCKS = {_Q8_0: 34, _Q4_0: 18, _Q4_1: 20}  # bytes per block of 32 values


def _dequantize_blocks(raw: np.ndarray, kind: int) -> torch.Tensor:
    """[..., row bytes] uint8 of one of ``_TORCH_BLOCKS``' formats → [..., row values] float32."""
    lead = raw.shape[:-1]
    blocks = torch.from_numpy(np.array(raw).reshape(-1, _TORCH_BLOCKS[kind]))  # a writable copy of the bytes
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    if kind == _Q8_0:
        x = d * blocks[:, 2:].contiguous().view(torch.int8).float()
    else:
        nib = blocks[:, 4:] if kind == _Q4_1 else blocks[:, 2:]
        q = torch.cat([nib & 0x0F, nib >> 4], dim=1).float()
        x = d * q + blocks[:, 2:4].contiguous().view(torch.float16).float() if kind == _Q4_1 else d * (q - 8)
    return x.reshape(*lead, -1)


def _dequantize(tensor: GgufTensor) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType(tensor.tensor_type)
    if tensor.tensor_type in _TORCH_BLOCKS:
        return _dequantize_blocks(tensor.data, tensor.tensor_type).reshape(tensor.shape)
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        arr = np.asarray(tensor.data)
    else:
        arr = quants.dequantize(tensor.data, kind)
    arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(tensor.shape)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def _canonical_gguf_name(gguf_name: str, rules: GgufRules) -> str | None:
    """``blk.3.attn_q.weight`` → ``layers.3.q`` (``blk.3.ffn_up_exps.weight`` → ``layers.3.experts.up``,
    every expert's); None for a tensor the model does not use."""
    if gguf_name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        name = rules.names.get(rest) or _GGUF_LAYER_NAMES.get(rest)
        if name is not None:
            return f"layers.{idx}.{name}"
    return None


def load_gguf(path: Path, device: torch.device = torch.device("cpu"),
              dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, Callable[[], torch.Tensor]]]:
    """Every tensor of a GGUF file (F32/F16/BF16/Q8_0/Q4_0/Q4_1/K-quants via gguf) by the directory's names,
    each a function that dequantizes it from the mapped file when called, converted to ``dtype`` on
    ``device``: q/k rows unpermuted where the converter permuted them, Gemma's norms back to w from the
    1 + w stored, the experts' stacked projections one tensor per expert (the stacked tensor read once
    for all of them). Read on demand, a model being built holds one layer's float weights at a time."""
    reader = read_gguf(path)
    cfg = gguf_config(reader)
    family = FAMILIES[cfg.architecture]
    tensors: dict[str, Callable[[], torch.Tensor]] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        name = _canonical_gguf_name(t.name, family.gguf)
        if name is None:
            log.warning("ignoring unknown GGUF tensor %s", t.name)
            continue
        part = name.rsplit(".", 1)[-1]
        heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads}.get(part.removesuffix("_bias"))
        offset = family.norm_offset if part.endswith("norm") else 0.0
        read = functools.partial(_read_gguf_tensor, t, heads if family.gguf.permuted_qk else None, device, dtype,
                                 offset)
        if ".experts." in name:  # [E, out, in]
            prefix, proj = name.split(".experts.")
            stacked = _StackedExperts(read, t.shape[0])
            tensors.update({f"{prefix}.experts.{e}.{proj}": functools.partial(stacked.expert, e)
                            for e in range(t.shape[0])})
        else:
            tensors[name] = read
    return cfg, tensors


class _StackedExperts:
    """A GGUF tensor of every expert's projection [E, out, in]: read when its first expert is asked for,
    and let go once each expert has taken its part."""

    def __init__(self, read: Callable[[], torch.Tensor], num_experts: int):
        self._read, self._parts, self._left = read, None, num_experts

    def expert(self, e: int) -> torch.Tensor:
        if self._parts is None:
            self._parts = list(self._read().unbind(0))
        part, self._parts[e] = self._parts[e], None
        self._left -= 1
        if self._left == 0:
            self._parts = None
        return part


def _read_gguf_tensor(tensor: GgufTensor, qk_heads: int | None, device: torch.device, dtype: torch.dtype,
                      offset: float = 0.0) -> torch.Tensor:
    """One tensor dequantized (float32), its Q/K rows unpermuted when ``qk_heads`` is given, ``offset``
    taken off (a Gemma norm), and converted; the float32 copy is gone when this returns."""
    w = _dequantize(tensor)
    if qk_heads is not None:
        w = _unpermute_qk(w, qk_heads)
    if offset:
        w -= offset
    return w.to(device=device, dtype=dtype)


def _canonical_hf_name(hf_name: str, family: Family) -> str | None:
    """``model.layers.3.self_attn.q_proj.weight`` → ``layers.3.q``; None for one the model does not use."""
    if hf_name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[hf_name]
    if hf_name.startswith("model.layers."):
        idx, rest = hf_name[len("model.layers."):].split(".", 1)
        name = family.hf_names.get(rest) or _HF_LAYER_NAMES.get(rest)
        if name is not None:
            return f"layers.{idx}.{name}"
        if ".experts." in rest:  # ``layers.3.experts.5.gate``
            expert, part = rest.split(".experts.", 1)[1].split(".", 1)
            if part in _HF_EXPERT_NAMES:
                return f"layers.{idx}.experts.{expert}.{_HF_EXPERT_NAMES[part]}"
    return None


# the quantized checkpoints a family's Hugging Face directory may be (``quantization_config.quant_method``):
# gpt-oss as published, its experts in MXFP4 (read by ``mxfp4_dequantize``)
_HF_QUANTIZED = {"gpt_oss": ("mxfp4",)}

# OCP MXFP4's E2M1 values, by 4-bit code (sign bit, then exponent and mantissa)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def hf_config(path: Path) -> ModelConfig:
    """A Hugging Face directory's config.json, refused in one line naming the model types there are
    before any other field of it is read; a quantized checkpoint (FP8, GPTQ, ...) refused too, its packed
    tensors and scales would be misread as float weights, except gpt-oss's MXFP4 experts (``_HF_QUANTIZED``)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    model_type = raw.get("model_type", "llama")
    if model_type not in SUPPORTED_HF_ARCHS:
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_HF_ARCHS)})")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        if method not in _HF_QUANTIZED.get(model_type, ()):
            raise ValueError(f"unsupported quantized checkpoint of {model_type} (quant_method {method!r}): float "
                             f"weights only (a bf16 or float32 export of the model)")
    return ModelConfig.from_hf(raw)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's MXFP4 experts as float32, in the layout of the same checkpoint's float export.

    ``blocks`` uint8 [E, rows, G, 16] hold each row's values in groups of 32, two 4-bit E2M1 codes a byte
    (the low nibble first); ``scales`` uint8 [E, rows, G] each group's power of two, biased by 127 (E8M0).
    So value 2j of group g is FP4[blocks[..., g, j] & 15] * 2^(scales[..., g] - 127), and 2j + 1 the high
    nibble's. The export stores the weight [E, in, out] where the blocks hold [E, out, in]: transposed."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype} do not pair: uint8 [E, rows, groups, 16] and [E, rows, groups]")
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2).long()  # [E, rows, G, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).transpose(1, 2).contiguous()


def _from_stacked_experts(name: str, w: torch.Tensor) -> torch.Tensor:
    """A stacked expert tensor of ``Family.stacked_experts`` (gpt-oss: [E, in, out], gate_up's gate at the
    even columns and up at the odd ones) in MoeBlock's layout: [E, out, in], gate rows then up rows."""
    part = name.rsplit(".", 1)[-1]
    if part in ("experts_gate_up", "experts_gate_up_bias"):
        w = torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1)
    return w.transpose(1, 2).contiguous() if part in ("experts_gate_up", "experts_down") else w


def load_hf_dir(path: Path, device: torch.device = torch.device("cpu"),
                dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, Callable[[], torch.Tensor]]]:
    """Every tensor of the safetensors files of a Hugging Face directory by the model's names, each a
    function that reads it from its mapped file when called, converted to ``dtype`` on ``device`` (as
    ``load_gguf``: a model being built reads one layer at a time)."""
    from safetensors import safe_open

    path = Path(path)
    cfg = hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    family = FAMILIES[cfg.architecture]
    # every file open at once (the readers keep theirs): an MXFP4 weight's blocks and scales may sit in
    # different shards
    where = {name: st for st in (safe_open(str(f), framework="pt") for f in files) for name in st.keys()}
    tensors: dict[str, Callable[[], torch.Tensor]] = {}
    for hf_name, st in where.items():
        if hf_name.endswith("_scales") and hf_name.removesuffix("_scales") + "_blocks" in where:
            continue  # read with its blocks
        packed = hf_name.endswith("_blocks")  # gpt-oss's MXFP4 experts: blocks, their scales beside
        name = _canonical_hf_name(hf_name.removesuffix("_blocks") if packed else hf_name, family)
        if name is not None and family.stacked_experts and ".experts_" in name:
            tensors[name] = functools.partial(_read_stacked_experts, where, hf_name, name, packed, device, dtype)
        elif name is not None and not packed:
            tensors[name] = functools.partial(_read_hf_tensor, st, hf_name, device, dtype)
        elif not hf_name.endswith("rotary_emb.inv_freq"):
            log.warning("ignoring unknown tensor %s", hf_name)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head", None)
    return cfg, tensors


def _read_hf_tensor(st, hf_name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return st.get_tensor(hf_name).to(device=device, dtype=dtype)


def _read_stacked_experts(where: dict, hf_name: str, name: str, packed: bool, device: torch.device,
                          dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint's stacked experts (``Family.stacked_experts``) in MoeBlock's layout; MXFP4 ones decoded."""
    st = where[hf_name]
    w = mxfp4_dequantize(st.get_tensor(hf_name), _scales_of(where, hf_name)) if packed else st.get_tensor(hf_name)
    return _from_stacked_experts(name, w).to(device=device, dtype=dtype)


def _scales_of(where: dict, blocks_name: str) -> torch.Tensor:
    """The MXFP4 scales of ``blocks_name`` (``where``: each tensor's open file)."""
    scales = blocks_name.removesuffix("_blocks") + "_scales"
    if scales not in where:
        raise ValueError(f"the checkpoint holds {blocks_name} without {scales}")
    return where[scales].get_tensor(scales)


# a layer's biases, taken where the checkpoint has them (gpt-oss's; DeepSeek-V3's router correction)
_OPTIONAL_LAYER_TENSORS = ("o_bias", "router_bias", "experts_gate_up_bias", "experts_down_bias", "router_correction")


def _stacked_experts(num_experts: int, p: str, tensors: dict[str, torch.Tensor], take,
                     fused) -> dict[str, torch.Tensor]:
    """Layer ``p``'s experts_gate_up [E, 2I, hidden] and experts_down [E, hidden, I]: as the checkpoint
    stacks them (``Family.stacked_experts``), or each expert's projections stacked here."""
    if p + "experts_gate_up" in tensors:
        return {"experts_gate_up": take(p + "experts_gate_up"), "experts_down": take(p + "experts_down")}
    experts = [f"{p}experts.{e}." for e in range(num_experts)]
    return {"experts_gate_up": torch.stack([fused(e, "gate_up", ("gate", "up")) for e in experts]),
            "experts_down": torch.stack([take(e + "down") for e in experts])}


def _layer_weights(cfg: ModelConfig, i: int, tensors: dict[str, torch.Tensor], take, fused,
                   norm) -> dict[str, torch.Tensor]:
    """Layer ``i``'s weights as the decoder layer takes them (``shared.model.llama.LlamaLayer``)."""
    p = f"layers.{i}."
    if cfg.mla is not None:  # latent attention (shared/model/mla.py): q_proj or its low-rank pair, the latent's
        q = ("q",) if cfg.mla.q_lora_rank is None else ("q_a", "q_a_norm", "q_b")
        w = {name: take(p + name) for name in (*q, "kv_a", "kv_a_norm", "kv_b")}
    else:
        w = {"qkv": fused(p, "qkv", ("q", "k", "v"))}
    w["o_proj"] = take(p + "o_proj")
    w.update({name: take(p + name) for name in _OPTIONAL_LAYER_TENSORS if p + name in tensors})
    if cfg.attention_sinks:
        w["sinks"] = take(p + "sinks")
    if cfg.moe is not None and i in cfg.moe.layers:  # every expert's projection stacked: [E, ...]
        w["router"] = take(p + "router")
        w.update(_stacked_experts(cfg.moe.num_experts, p, tensors, take, fused))
        if p + "shared_down" in tensors:  # DeepSeek-V3's shared experts, as one SwiGLU
            w["shared_gate_up"] = fused(p, "shared_gate_up", ("shared_gate", "shared_up"))
            w["shared_down"] = take(p + "shared_down")
    else:
        w["gate_up"], w["down"] = fused(p, "gate_up", ("gate", "up")), take(p + "down")
    if cfg.pre_norms:
        w["attn_norm"], w["mlp_norm"] = norm(p + "attn_norm"), norm(p + "mlp_norm")
    if cfg.post_norms:
        w["attn_out_norm"], w["mlp_out_norm"] = norm(p + "attn_out_norm"), norm(p + "mlp_out_norm")
    if cfg.attention_bias:
        w["qkv_bias"] = torch.cat([take(p + "q_bias"), take(p + "k_bias"), take(p + "v_bias")])
    if cfg.qk_norm:
        w["q_norm"], w["k_norm"] = norm(p + "q_norm"), norm(p + "k_norm")
    return w


def build_model(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor | Callable[[], torch.Tensor]], device: torch.device,
    dtype: torch.dtype, group: Collectives | None = None, pipeline: PipelineStage | None = None,
    quantize_layers: str | None = None,
) -> LlamaModel:
    """The model from its named tensors (each a tensor, or a function that reads it: ``load_gguf``'s);
    with ``group``, that rank's shard of it (the full tensors are read, cut and let go layer by layer);
    with ``pipeline``, its stage's layers (and the embedding and LM head on stage 0 alone). Layers are
    made one at a time, so a layer's tensors that are read on demand are in memory only while it is
    made, and with ``quantize_layers`` (``LlamaModel``'s) no float layer outlives its making."""
    def take(name: str) -> torch.Tensor:
        try:
            value = tensors.pop(name)
        except KeyError:
            raise ValueError(f"model weights are missing tensor {name!r}") from None
        return (value() if callable(value) else value).to(device=device, dtype=dtype)

    def fused(prefix: str, name: str, parts: tuple[str, ...]) -> torch.Tensor:
        """A fused weight: as the checkpoint stores it (Phi-3), or its parts concatenated."""
        return take(prefix + name) if prefix + name in tensors else torch.cat([take(prefix + n) for n in parts])

    offset = FAMILIES.get(cfg.architecture, Family()).norm_offset

    def norm(name: str) -> torch.Tensor:
        """An RMSNorm's weight as the model multiplies by it: Gemma's stored ``w`` scales by 1 + w."""
        return take(name) + offset if offset else take(name)

    rank, tp = (group.rank, group.size) if group is not None else (0, 1)
    stage0 = pipeline is None or pipeline.stage == 0
    top = {"norm": norm("norm")}
    if stage0:
        top["embed"] = take("embed")
        if not cfg.tie_word_embeddings:
            top["lm_head"] = take("lm_head")
    if stage0:
        top = shard_top(cfg, top, rank, tp)

    def layers():
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            if pipeline is not None and i not in pipeline.layers:
                for name in [n for n in tensors if n.startswith(p)]:
                    del tensors[name]  # another stage's
                continue
            yield shard_layer(cfg, _layer_weights(cfg, i, tensors, take, fused, norm), rank, tp)

    count = len(pipeline.layers) if pipeline is not None else cfg.num_layers
    made = tqdm(layers(), total=count, desc=f"building {cfg.architecture} layers", unit="layer", leave=False)
    model = LlamaModel(cfg, top, made, group, pipeline, quantize_layers)
    tensors.clear()
    return model


def read_config(path: Path, fmt: str) -> ModelConfig:
    """The model's shape alone, without its tensors (to check a parallel split before loading)."""
    if fmt == "gguf":
        return gguf_config(read_gguf(path))
    return hf_config(path)


def load_model(path: Path, fmt: str, device: torch.device, dtype: torch.dtype,
               group: Collectives | None = None, quantization: str = "none",
               pipeline: PipelineStage | None = None) -> LlamaModel:
    """Load a model from a GGUF file (``fmt="gguf"``) or an HF directory (``fmt="hf"``); with
    ``group``, that rank's shard, refused before any weight is kept where the model's shape does not
    split into ``group.size`` ranks at ``quantization`` (shared/model/parallel.py); with
    ``pipeline``, its stage's layers. A ``quantization`` of ``LAYERWISE_QUANTIZATIONS`` is applied to
    each layer as it is made (the caller's ``model.quantize`` then does the LM head), so a GGUF file,
    read tensor by tensor, never stands in memory as a whole float model."""
    load = load_gguf if fmt == "gguf" else load_hf_dir
    cfg, tensors = load(path, device, dtype)
    layerwise = quantization if quantization in LAYERWISE_QUANTIZATIONS else None
    if group is None and pipeline is None:
        return build_model(cfg, tensors, device, dtype, quantize_layers=layerwise)
    check_tensor_parallel(cfg, group.size if group is not None else 1, quantization)
    model = build_model(cfg, tensors, device, dtype, group, pipeline, layerwise)
    _return_freed_memory()  # the whole tensors this rank read and cut are garbage now
    return model


def _return_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc keeps them otherwise, and a rank's
    resident memory would stay at the whole model's after it kept its shard)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
