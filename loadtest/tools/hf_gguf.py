"""A Hugging Face directory's weights as a float32 GGUF file, named, keyed and transformed as
llama.cpp's converter (convert_hf_to_gguf.py) writes them: gguf-py's tensor-name map and metadata
keys; q/k rows permuted for the families its LlamaModel converts (Llama, Granite, SmolLM3, Mixtral);
Gemma's norm weights stored as 1 + w; each layer's experts stacked into one tensor per projection.
The tests check a family's GGUF path against its Hugging Face path with it, and a model made here
serves like a converted one; loadtest.tools.synth_model writes its random-weight family shapes with
the same names and keys. A model whose file would lose something llama.cpp assumes instead of
reading (Gemma's softmax scale, which layers are windowed or rotate without rotary, Qwen3-MoE's
renormalisation) is refused rather than written as another model.

    python -m loadtest.tools.hf_gguf HF_DIR OUT.gguf
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

# model_type -> (gguf-py's MODEL_ARCH, whether the converter permutes q/k: its LlamaModel and subclasses)
ARCHS = {"llama": ("LLAMA", True), "qwen2": ("QWEN2", False), "qwen3": ("QWEN3", False),
         "phi3": ("PHI3", False), "olmo2": ("OLMO2", False), "granite": ("GRANITE", True),
         "gemma2": ("GEMMA2", False), "gemma3_text": ("GEMMA3", False), "smollm3": ("SMOLLM3", True),
         "mixtral": ("LLAMA", True), "qwen3_moe": ("QWEN3MOE", False)}
_GEMMAS = ("gemma2", "gemma3_text")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(.*)$")  # model.layers.0.mlp.experts.3.gate_proj.weight


def write_gguf(hf_dir: Path, out: Path) -> Path:
    """``out``, written from ``hf_dir`` (config.json and *.safetensors)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    model_type = cfg["model_type"]
    arch, permuted = gguf_arch(cfg)
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    write_metadata(writer, cfg)
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    tensors = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        tensors.update(load_file(file))
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    for hf_name, value in _stack_experts(tensors).items():
        value = np.asarray(value, dtype=np.float32)
        if permuted and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            value = _permute(value, heads)
        elif permuted and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            value = _permute(value, kv_heads)
        if model_type in _GEMMAS and hf_name.endswith("norm.weight"):
            value = value + np.float32(1.0)  # Gemma's RMSNorm scales by 1 + w: the converter stores 1 + w
        writer.add_tensor(gguf_tensor_name(names, hf_name, model_type), np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def gguf_arch(cfg: dict) -> tuple[object, bool]:
    """gguf-py's MODEL_ARCH for a config.json, and whether the converter permutes its q/k rows; a family
    Tandem does not write, or a model its file would misstate (``unstated``), raises ValueError."""
    import gguf

    model_type = cfg["model_type"]
    if model_type not in ARCHS:
        raise ValueError(f"{model_type!r}: only {', '.join(ARCHS)} are written")
    if reason := unstated(cfg):
        raise ValueError(f"{model_type}: {reason}, which a GGUF file does not state (llama.cpp assumes otherwise)")
    arch_name, permuted = ARCHS[model_type]
    return getattr(gguf.MODEL_ARCH, arch_name), permuted


def gguf_tensor_name(names, hf_name: str, model_type: str) -> str:
    """``hf_name``'s GGUF name in gguf-py's map ``names`` (``gguf.get_tensor_name_map``)."""
    gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if gguf_name is None:
        raise ValueError(f"no GGUF name for {hf_name} in {model_type}")
    return gguf_name


def write_metadata(writer, cfg: dict) -> None:
    """The keys the converter's TextModel writes, and each family's own."""
    import gguf

    model_type = cfg["model_type"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's global layers'
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg.get("max_position_embeddings", 4096))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    if model_type != "granite":  # the converter drops Granite's head_dim
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(cfg["vocab_size"])
    if experts := cfg.get("num_local_experts") or cfg.get("num_experts"):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if "moe_intermediate_size" in cfg:
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if model_type == "granite":  # its multipliers, named as scales
        writer.add_attention_scale(cfg["attention_multiplier"])
        writer.add_embedding_scale(cfg["embedding_multiplier"])
        writer.add_residual_scale(cfg["residual_multiplier"])
        writer.add_logit_scale(cfg["logits_scaling"])
    if model_type == "phi3":  # 0: no window
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
    if model_type in _GEMMAS:
        if cfg.get("attn_logit_softcapping"):
            writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        writer.add_sliding_window(cfg["sliding_window"])


def unstated(cfg: dict) -> str | None:
    """What of the model a converted file would lose: llama.cpp takes Gemma's softmax scale from the
    head size, Gemma 2's windowed layers as every other one, Gemma 3's as all but every 6th (rotating
    with base 1e4), SmolLM3's layers without rotary as every 4th, and renormalises Qwen3-MoE's experts
    in every layer; the converter writes no window for Mixtral or SmolLM3."""
    model_type, num_layers = cfg["model_type"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if model_type in _GEMMAS:
        big = num_layers == (46 if model_type == "gemma2" else 62)
        if cfg.get("query_pre_attn_scalar") != (cfg["hidden_size"] // cfg["num_attention_heads"] if big else head_dim):
            return f"query_pre_attn_scalar {cfg.get('query_pre_attn_scalar')} other than the head size"
        period = 2 if model_type == "gemma2" else 6
        windowed = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)]
        if cfg.get("layer_types") and cfg["layer_types"] != windowed:
            return f"layer_types {cfg['layer_types']} other than all but every {period}th windowed"
        local = (cfg.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta")
        if model_type == "gemma3_text" and local not in (None, 10000.0):
            return f"a local rope base {local} other than 1e4"
    if model_type == "smollm3":
        uses_rope = cfg.get("no_rope_layers")
        if uses_rope is not None and uses_rope != [int((i + 1) % 4 != 0) for i in range(num_layers)]:
            return f"no_rope_layers {uses_rope} other than every 4th layer without rotary"
    if model_type in ("smollm3", "mixtral") and cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        return f"a sliding_window {cfg['sliding_window']}"
    if model_type == "qwen3_moe":
        if not cfg.get("norm_topk_prob"):
            return "experts' weights not renormalised (norm_topk_prob false)"
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            return "layers with the dense MLP"
    return None


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The converter's LlamaModel.permute: each head's rotate-half rows interleaved, as ggml's rotary
    takes them."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each layer's ``experts.<e>.<proj>`` stacked in expert order into ``experts.<proj>`` [E, out, in],
    as the converter merges them; the other tensors as they are."""
    out, experts = {}, {}
    for name, value in tensors.items():
        if m := _EXPERT.match(name):
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = value
        else:
            out[name] = value
    for name, by_index in experts.items():
        out[name] = np.stack([by_index[e] for e in range(len(by_index))])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.tools.hf_gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("hf_dir", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    print(write_gguf(args.hf_dir, args.out))


if __name__ == "__main__":
    main()
