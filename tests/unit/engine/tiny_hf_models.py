"""Tiny random-weight Hugging Face models saved as real safetensors directories."""

from __future__ import annotations

import torch

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2)


def save_tiny(kind: str, path, **overrides) -> torch.nn.Module:
    """``overrides``: fields of ``TINY`` to change (e.g. ``num_hidden_layers``)."""
    import transformers

    shape = TINY | overrides

    torch.manual_seed(0)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**shape, tie_word_embeddings=True)
    elif kind == "llama3":
        cfg = transformers.LlamaConfig(**shape, tie_word_embeddings=False, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    else:
        cfg = transformers.LlamaConfig(**shape, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


