"""Tiny random-weight Hugging Face models saved as real safetensors directories."""

from __future__ import annotations

import torch

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2)
# the tiny models' sliding window: the tests' prompts (40 to 128 tokens) and generations run far past it
SLIDING_WINDOW = 12
# DeepSeek-V3: latent attention (4 heads, latent 32 + 8, q through a rank-48 pair), layer 0 dense, layers 1-2
# 2 of 8 narrow experts from 1 of 2 groups (so the groups' choice matters) beside a shared expert; no eos
# (transformers' generate would keep the 0 of the tests' prompts off as padding and eos off under min_new_tokens)
DEEPSEEK = dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
                qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1, tie_word_embeddings=False,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)


def save_tiny(kind: str, path, **overrides) -> torch.nn.Module:
    """``overrides``: fields of ``TINY`` to change (e.g. ``num_hidden_layers``)."""
    import transformers

    shape = TINY | overrides

    torch.manual_seed(0)
    if kind == "mistral":  # every layer windowed
        cfg = transformers.MistralConfig(**shape, sliding_window=SLIDING_WINDOW, tie_word_embeddings=False)
    elif kind == "qwen3_window":  # layers from max_window_layers (1) on windowed, layer 0 global
        cfg = transformers.Qwen3Config(**shape, head_dim=32, use_sliding_window=True, sliding_window=SLIDING_WINDOW,
                                       max_window_layers=1, tie_word_embeddings=False)
    elif kind == "mixtral_window":  # every layer windowed, experts in place of the MLP
        cfg = transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=SLIDING_WINDOW)
    elif kind == "phi3_window":  # every layer windowed, from the fused checkpoint tensors
        cfg = transformers.Phi3Config(**shape, sliding_window=SLIDING_WINDOW, tie_word_embeddings=False,
                                      pad_token_id=None, bos_token_id=1, eos_token_id=2)
    elif kind == "smollm3_window":  # its layer without rotary (0) windowed, the other global
        cfg = transformers.SmolLM3Config(**shape, no_rope_layers=[0, 1], use_sliding_window=True,
                                         sliding_window=SLIDING_WINDOW, pad_token_id=None, bos_token_id=1,
                                         eos_token_id=2)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**shape, tie_word_embeddings=True)
    elif kind == "qwen3":  # head_dim 32, not hidden / heads = 16: the explicit one must be used
        cfg = transformers.Qwen3Config(**shape, head_dim=32, tie_word_embeddings=False)
    elif kind == "phi3":  # the defaults' ids (pad 32000) lie outside the tiny vocabulary
        cfg = transformers.Phi3Config(**shape, tie_word_embeddings=False, pad_token_id=None, bos_token_id=1,
                                      eos_token_id=2)
    elif kind == "olmo2":
        cfg = transformers.Olmo2Config(**shape, tie_word_embeddings=False, pad_token_id=None, bos_token_id=1,
                                       eos_token_id=2)
    elif kind == "granite":  # multipliers far from 1 (the scale 0.5, not head_dim ** -0.5 = 0.25)
        cfg = transformers.GraniteConfig(**shape, tie_word_embeddings=True, embedding_multiplier=3.0,
                                         residual_multiplier=0.5, attention_multiplier=0.5, logits_scaling=4.0)
    elif kind == "gemma2":  # caps low enough to bend random scores; layer 0 windowed, layer 1 global
        cfg = transformers.Gemma2Config(**shape, head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                        final_logit_softcapping=10.0, sliding_window=SLIDING_WINDOW,
                                        pad_token_id=None, bos_token_id=1, eos_token_id=2)
    elif kind == "gemma3_text":  # local (windowed) layers (0, 2) rotate with base 100, the global one (1) with 1e4 x 8
        cfg = transformers.Gemma3TextConfig(
            **(shape | dict(num_hidden_layers=3)), head_dim=16, query_pre_attn_scalar=24,
            sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
            pad_token_id=None, bos_token_id=1, eos_token_id=2)
    elif kind == "smollm3":  # layer 0 without rotary, layer 1 with it
        cfg = transformers.SmolLM3Config(**shape, no_rope_layers=[0, 1], pad_token_id=None, bos_token_id=1,
                                         eos_token_id=2)
    elif kind == "mixtral":  # 2 of 4 experts, always renormalised
        cfg = transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
    elif kind == "qwen3_moe":  # 2 of 8 narrow experts, not renormalised; layer 1 keeps the dense MLP
        cfg = transformers.Qwen3MoeConfig(**(shape | dict(num_hidden_layers=3)), head_dim=32, num_experts=8,
                                          num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
                                          norm_topk_prob=False, tie_word_embeddings=False)
    # as a GGUF can state them (llama.cpp's assumptions where the file is silent): Gemma's softmax scale the
    # head size's; Gemma 3's windowed layers all but every 6th, rotating with base 1e4; SmolLM3's layers
    # without rotary every 4th; Qwen3-MoE's experts renormalised in every layer
    elif kind == "gemma2_gguf":
        cfg = transformers.Gemma2Config(**shape, head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                                        final_logit_softcapping=10.0, sliding_window=SLIDING_WINDOW,
                                        pad_token_id=None, bos_token_id=1, eos_token_id=2)
    elif kind == "gemma3_gguf":  # layers 0-4 local, 5 global (1e6, linear x 8)
        cfg = transformers.Gemma3TextConfig(
            **(shape | dict(num_hidden_layers=6)), head_dim=16, query_pre_attn_scalar=16,
            sliding_window=SLIDING_WINDOW, final_logit_softcapping=10.0,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            pad_token_id=None, bos_token_id=1, eos_token_id=2)
    elif kind == "smollm3_gguf":  # layer 3 without rotary
        cfg = transformers.SmolLM3Config(**(shape | dict(num_hidden_layers=4)), pad_token_id=None, bos_token_id=1,
                                         eos_token_id=2)
    elif kind == "qwen3_moe_gguf":
        cfg = transformers.Qwen3MoeConfig(**shape, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False)
    elif kind == "gpt_oss":  # layers 0 and 2 windowed, 1 global; 2 of 8 experts; YaRN from 64 positions;
        # a SwiGLU limit the random gates cross (the checkpoints' 7 is far above them)
        cfg = transformers.GptOssConfig(
            **(shape | dict(num_hidden_layers=3, intermediate_size=32)), head_dim=16, num_local_experts=8,
            num_experts_per_tok=2, sliding_window=SLIDING_WINDOW, swiglu_limit=1.5, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})
    elif kind == "deepseek_v3":  # ``overrides`` win over DEEPSEEK's fields too (q_lora_rank=None, a rope scaling)
        cfg = transformers.DeepseekV3Config(**(TINY | DEEPSEEK | overrides))
    elif kind == "llama3":
        cfg = transformers.LlamaConfig(**shape, tie_word_embeddings=False, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    else:
        cfg = transformers.LlamaConfig(**shape, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    if kind not in ("llama", "qwen2", "llama3"):  # norms start at ones (Gemma's at zeros, for 1 + w):
        # random ones catch a weight loaded in the wrong place
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
                elif name.endswith("gate.weight"):  # a router (Qwen3-MoE's starts at zeros): routes apart
                    param.normal_(0.0, 0.2)
                elif name.endswith("sinks"):  # gpt-oss's: logits that take a good share of each softmax
                    param.normal_(1.0, 1.0)
                elif name.endswith("bias") and kind == "gpt_oss":  # its biases start at zeros: nonzero ones
                    param.normal_(0.0, 0.2)  # catch a bias dropped or put on the wrong expert or column
            for name, buffer in model.named_buffers():  # DeepSeek-V3's router correction (zeros): one that moves
                if name.endswith("e_score_correction_bias"):  # the choice of experts
                    buffer.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return model


