"""A Hugging Face directory's weights as a float32 GGUF file, named and keyed as llama.cpp's
converter writes them (gguf-py's tensor-name map and metadata keys), for the families whose q/k
rows the converter leaves as they are (Qwen2, Qwen3; it permutes Llama's and Mistral's, which
``synth_model`` writes). The tests check a family's GGUF path against its Hugging Face path with
it, and a model made here serves like a converted one.

    python -m loadtest.tools.hf_gguf HF_DIR OUT.gguf
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ARCHS = {"qwen2": "QWEN2", "qwen3": "QWEN3"}  # model_type -> gguf-py's MODEL_ARCH


def write_gguf(hf_dir: Path, out: Path) -> Path:
    """``out``, written from ``hf_dir`` (config.json and *.safetensors)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    model_type = cfg["model_type"]
    if model_type not in ARCHS:
        raise ValueError(f"{model_type!r}: only {', '.join(ARCHS)} are written as they are (no q/k permutation)")
    arch = getattr(gguf.MODEL_ARCH, ARCHS[model_type])
    name = gguf.MODEL_ARCH_NAMES[arch]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), name)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg.get("max_position_embeddings", 4096))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(cfg["vocab_size"])
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    tensors = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        tensors.update(load_file(file))
    for hf_name, value in tensors.items():
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        writer.add_tensor(gguf_name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.tools.hf_gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("hf_dir", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    print(write_gguf(args.hf_dir, args.out))


if __name__ == "__main__":
    main()
