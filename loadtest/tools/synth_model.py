"""Random-weight models of the sizes people serve, for benchmarks: same file for Tandem and llama.cpp.

    python -m loadtest.tools.synth_model --shape llama-1b --format gguf-q8_0 --out /tmp/llama-1b-q8_0.gguf

Shapes (``--shape``): ``llama-1b`` is Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192, rope theta 500000, tied embeddings), ``llama-8b`` Llama-3-8B (4096, 32 layers,
32/8 heads, 14336, untied), ``smollm2-135m`` SmolLM2-135M, ``smollm2-tp`` its size with 8 heads and 4 KV heads
(TP=2 and 4 divide it), ``smollm2-tp-narrow`` the same
layers and heads with head size 8 (a step's fixed cost), ``tiny`` a 2-layer model for tests, ``heads-32`` a 2-layer model
with 32 heads and 8 KV heads of size 8 (tensor-parallel tests).
Every shape takes its vocabulary from a tokenizer GGUF (``--tokenizer-from``, default the
SmolLM2-135M GGUF that ``tandem model fetch`` caches, 49152 tokens), so the embedding and LM head
are smaller than Llama 3's (128256 tokens): llama-1b has 1.07B parameters, llama-8b 7.38B. No
Llama-3 rope scaling is written (context 8192, like Llama-3-8B's).

Other families, GGUF only, with llama.cpp's architecture, tensor names and metadata keys (as
loadtest.tools.hf_gguf writes them; the vocabulary again the tokenizer's): ``qwen3-1.7b`` Qwen3-1.7B
(hidden 2048, 28 layers, 16 heads and 8 KV heads of 128, intermediate 6144, q/k norms, tied; 1.51B
parameters), ``gemma3-1b`` Gemma-3-1B (1152, 26 layers, 4 heads and 1 KV head of 256, intermediate 6912,
GELU, windows of 512 in all but every 6th layer, no soft-capping, tied; 0.75B), ``olmo2-1b``
OLMo-2-0425-1B (2048, 16 layers, 16/16 heads, 8192, norms after each sublayer, untied; 1.28B),
``granite-2b`` Granite-3.1-2B (2048, 40 layers, 32/8 heads, 8192, its embedding, residual, attention
and logits multipliers, tied; 2.53B), and ``qwen3-moe-a1b``, a mixture of experts with Qwen3-30B-A3B's
layer (2048, 32/4 heads of 128, experts 768 wide, 8 per token) at a third of its depth (16 layers) and
a quarter of its experts (32): 2.92B parameters, 1.11B of them active per token. ``--tiny`` writes a
family's shape at test size.

Weights are normal with std 0.02 (norms at 1), so activations stay in the range of a trained
model's and a forward pass neither overflows nor collapses (every family's norms scale by 1: Gemma's
GGUF stores 1 + w); the text they generate is noise.

Formats (``--format``): ``gguf-q8_0``, ``gguf-q4_0`` (2-D weights and stacked experts quantized with
``gguf.quants``, norms and a router in F32, as llama.cpp's converter leaves them), ``gguf-f16``, and
``hf`` (a directory: config.json, bfloat16 safetensors in shards of at most 2 GiB with their index, tokenizer.json and
tokenizer_config.json). The same ``--seed`` gives the same model in every format: Q and K are
written in llama.cpp's row order in a GGUF and in Hugging Face's in the directory.

Memory stays at about one float32 tensor plus its encoded form (the largest, llama-8b's LM head,
is 0.8 GB): the GGUF header is written first from the tensors' shapes, then each tensor is made,
encoded, written and dropped. Quantizing runs in numpy on the CPU: llama-1b Q8_0 took 40 s and
0.8 GB peak RSS on 2 cores; llama-8b takes about 7 times as long (not measured).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

INIT_STD = 0.02
HF_SHARD_BYTES = 2 << 30
QUANT_CHUNK_ELEMENTS = 1 << 24  # rows are quantized this many elements at a time


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float
    tie_word_embeddings: bool
    context_length: int = 8192
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def step_linear_shapes(self) -> list[tuple[int, int]]:
        """[out, in] of every decoder layer's linear weights as the engine fuses them (qkv, o,
        gate_up, down), layer after layer: what one decode step streams before the LM head."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return [(qkv, self.hidden_size), (self.hidden_size, self.num_heads * self.head_dim),
                (2 * self.intermediate_size, self.hidden_size),
                (self.hidden_size, self.intermediate_size)] * self.num_layers


SHAPES = {
    "llama-1b": Shape(2048, 16, 32, 8, 8192, 500000.0, tie_word_embeddings=True),
    "llama-8b": Shape(4096, 32, 32, 8, 14336, 500000.0, tie_word_embeddings=False),
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, 100000.0, tie_word_embeddings=True),
    # SmolLM2-135M's depth and size with heads that TP=2 and TP=4 divide (8 of size 64, 4 KV heads):
    # the tensor-parallel calibration (loadtest.calibrate.parallel) on a CPU with two or four cores
    "smollm2-tp": Shape(512, 30, 8, 4, 1536, 100000.0, tie_word_embeddings=True),
    # the same depth, heads and operators with almost no arithmetic: what a step costs regardless of size
    "smollm2-tp-narrow": Shape(64, 30, 8, 4, 128, 100000.0, tie_word_embeddings=True),
    "tiny": Shape(64, 2, 4, 2, 128, 10000.0, tie_word_embeddings=False, context_length=512),
    # many heads on a small model: tensor parallelism at 2, 4 and 8 ranks in seconds (head size 8)
    "heads-32": Shape(256, 2, 32, 8, 512, 10000.0, tie_word_embeddings=False, context_length=1024),
}
FORMATS = ("gguf-q8_0", "gguf-q4_0", "gguf-f16", "hf")

# Other families, as their config.json states them (the keys loadtest.tools.hf_gguf writes into a GGUF);
# ``vocab_size`` comes from the tokenizer GGUF. Written as GGUF only.
FAMILY_SHAPES: dict[str, dict] = {
    # Qwen3-1.7B: q/k RMSNorm over each head, head size 128 (not hidden / heads)
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True),
    # Gemma-3-1B: 1 KV head of 256, all but every 6th layer windowed (512), GELU, norms after each sublayer too
    "gemma3-1b": dict(model_type="gemma3_text", hidden_size=1152, num_hidden_layers=26, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, intermediate_size=6912, rope_theta=1000000.0,
                      rms_norm_eps=1e-6, max_position_embeddings=32768, sliding_window=512,
                      query_pre_attn_scalar=256, tie_word_embeddings=True),
    # OLMo-2-0425-1B: norms after attention and the MLP instead of before, q/k RMSNorm over all heads
    "olmo2-1b": dict(model_type="olmo2", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                     num_key_value_heads=16, intermediate_size=8192, rope_theta=500000.0, rms_norm_eps=1e-6,
                     max_position_embeddings=4096, tie_word_embeddings=False),
    # Granite-3.1-2B (the smallest dense Granite 3): embedding, residual, attention and logits multipliers
    "granite-2b": dict(model_type="granite", hidden_size=2048, num_hidden_layers=40, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=8192, rope_theta=5000000.0, rms_norm_eps=1e-5,
                       max_position_embeddings=131072, tie_word_embeddings=True, embedding_multiplier=12.0,
                       residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0),
    # Qwen3-30B-A3B's layer (hidden 2048, 32 heads and 4 KV heads of 128, experts 768 wide, 8 of them per
    # token, renormalised) at a third of its depth (16 layers) and a quarter of its experts (32)
    "qwen3-moe-a1b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=32, num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1000000.0,
                          rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False),
}
# a family's shape at test size (``scaled_down``): whichever of these keys the family has
TINY_FAMILY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                   moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, sliding_window=8,
                   query_pre_attn_scalar=16, max_position_embeddings=512)


@dataclass(frozen=True)
class TensorSpec:
    hf_name: str
    gguf_name: str
    shape: tuple[int, ...]  # HF orientation: [out_features, in_features]
    qk_heads: int = 0  # Q or K weight: its head count (llama.cpp permutes its rows)
    keep_f32: bool = False  # written in float32 whatever the format (a router, as the converter keeps it)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))


def tensor_plan(shape: Shape, vocab_size: int) -> list[TensorSpec]:
    """Every tensor of the model, in the order llama.cpp's converter writes them."""
    h, d = shape.hidden_size, shape.head_dim
    plan = [TensorSpec("model.embed_tokens.weight", "token_embd.weight", (vocab_size, h))]
    for i in range(shape.num_layers):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        plan += [
            TensorSpec(hf + "input_layernorm.weight", gg + "attn_norm.weight", (h,)),
            TensorSpec(hf + "self_attn.q_proj.weight", gg + "attn_q.weight", (shape.num_heads * d, h),
                       qk_heads=shape.num_heads),
            TensorSpec(hf + "self_attn.k_proj.weight", gg + "attn_k.weight", (shape.num_kv_heads * d, h),
                       qk_heads=shape.num_kv_heads),
            TensorSpec(hf + "self_attn.v_proj.weight", gg + "attn_v.weight", (shape.num_kv_heads * d, h)),
            TensorSpec(hf + "self_attn.o_proj.weight", gg + "attn_output.weight", (h, shape.num_heads * d)),
            TensorSpec(hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight", (h,)),
            TensorSpec(hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight", (shape.intermediate_size, h)),
            TensorSpec(hf + "mlp.up_proj.weight", gg + "ffn_up.weight", (shape.intermediate_size, h)),
            TensorSpec(hf + "mlp.down_proj.weight", gg + "ffn_down.weight", (h, shape.intermediate_size)),
        ]
    plan.append(TensorSpec("model.norm.weight", "output_norm.weight", (h,)))
    if not shape.tie_word_embeddings:
        plan.append(TensorSpec("lm_head.weight", "output.weight", (vocab_size, h)))
    return plan


def scaled_down(cfg: dict) -> dict:
    """A family's config at test size: hidden 64, 4 heads of 16 (its KV heads cut to 4 where every head
    has its own, else to at most 2), 8 experts of 32 (2 per token), a window of 8; 2 layers, or 6 for
    Gemma 3 so that its 6th layer is the global one."""
    small = cfg | {key: value for key, value in TINY_FAMILY.items() if key in cfg}
    kv_heads = cfg["num_key_value_heads"]
    small["num_key_value_heads"] = 4 if kv_heads == cfg["num_attention_heads"] else min(kv_heads, 2)
    small["num_hidden_layers"] = 6 if cfg["model_type"] == "gemma3_text" else 2
    return small


def family_config(shape_name: str, vocab_size: int, tiny: bool = False) -> dict:
    """``FAMILY_SHAPES[shape_name]`` with the tokenizer's vocabulary, at test size if ``tiny``."""
    cfg = FAMILY_SHAPES[shape_name] | {"vocab_size": vocab_size}
    return scaled_down(cfg) if tiny else cfg


# a decoder layer's norms where they are not Llama's (before attention, before the MLP)
_LAYER_NORMS = {"olmo2": ("post_attention_layernorm", "post_feedforward_layernorm"),
                "gemma3_text": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                "post_feedforward_layernorm")}


def _family_layer(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name after ``model.layers.<i>.``, shape) of a family's decoder layer: OLMo 2 has no norm
    before attention and the MLP, Gemma 3 norms both before and after each, OLMo 2 norms all of q and of
    k, Qwen3 and Gemma 3 each head; Qwen3-MoE's experts are stacked [E, out, in] as the converter does."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, model_type = cfg.get("head_dim") or h // heads, cfg["model_type"]
    norms = _LAYER_NORMS.get(model_type, ("input_layernorm", "post_attention_layernorm"))
    layer = [(f"{name}.weight", (h,)) for name in norms]
    layer += [("self_attn.q_proj.weight", (heads * d, h)), ("self_attn.k_proj.weight", (kv * d, h)),
              ("self_attn.v_proj.weight", (kv * d, h)), ("self_attn.o_proj.weight", (h, heads * d))]
    if model_type == "olmo2":
        layer += [("self_attn.q_norm.weight", (heads * d,)), ("self_attn.k_norm.weight", (kv * d,))]
    elif model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
        layer += [("self_attn.q_norm.weight", (d,)), ("self_attn.k_norm.weight", (d,))]
    if experts := cfg.get("num_experts"):
        width = cfg["moe_intermediate_size"]
        return layer + [("mlp.gate.weight", (experts, h)), ("mlp.experts.gate_proj.weight", (experts, width, h)),
                        ("mlp.experts.up_proj.weight", (experts, width, h)),
                        ("mlp.experts.down_proj.weight", (experts, h, width))]
    width = cfg["intermediate_size"]
    return layer + [("mlp.gate_proj.weight", (width, h)), ("mlp.up_proj.weight", (width, h)),
                    ("mlp.down_proj.weight", (h, width))]


def family_plan(cfg: dict) -> list[TensorSpec]:
    """Every tensor of a family's model with its GGUF name from gguf-py's map (as llama.cpp's converter
    names it), q/k marked for permuting where the converter permutes them (Granite), a router in float32."""
    import gguf

    from loadtest.tools import hf_gguf

    arch, permuted = hf_gguf.gguf_arch(cfg)
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    h, vocab, model_type = cfg["hidden_size"], cfg["vocab_size"], cfg["model_type"]
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    hf = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        hf += [(f"model.layers.{i}.{name}", shape) for name, shape in _family_layer(cfg)]
    hf.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        hf.append(("lm_head.weight", (vocab, h)))
    return [TensorSpec(name, hf_gguf.gguf_tensor_name(names, name, model_type), shape,
                       qk_heads=heads.get(name.split(".")[-2], 0) if permuted else 0,
                       keep_f32=name.endswith("mlp.gate.weight"))
            for name, shape in hf]


def random_weights(plan: list[TensorSpec], seed: int) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """Each tensor of ``plan`` in turn, float32 in HF orientation: norms 1 (Gemma's too: its GGUF stores
    1 + w, the HF weight w being 0 at initialisation), the rest N(0, 0.02²).
    One generator in plan order, so a seed gives the same model whatever the output format."""
    gen = torch.Generator().manual_seed(seed)
    for spec in plan:
        if len(spec.shape) == 1:
            yield spec, torch.ones(spec.shape)
        else:
            yield spec, torch.randn(spec.shape, generator=gen).mul_(INIT_STD)


def _progress(plan: list[TensorSpec], out: Path):
    return tqdm(total=sum(s.numel for s in plan), unit="param", unit_scale=True, file=sys.stderr,
                desc=f"writing {out.name}")


# -- the tokenizer ----------------------------------------------------------------------------------

def tokenizer_gguf(name_or_path: str) -> Path:
    from shared.model.registry import resolve_model

    source = resolve_model(name_or_path)
    if source.format != "gguf":
        raise SystemExit(f"--tokenizer-from must be a GGUF file or a GGUF alias, not {source.path}")
    return source.path


def tokenizer_fields(path: Path) -> list[tuple[str, object, list]]:
    """Every ``tokenizer.*`` metadata field of a GGUF: (key, value, GGUF value types)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return [(key, f.contents(), f.types) for key, f in reader.fields.items() if key.startswith("tokenizer.")]


def _vocab_size(fields: list[tuple[str, object, list]]) -> int:
    return len(next(value for key, value, _ in fields if key == "tokenizer.ggml.tokens"))


# -- GGUF -------------------------------------------------------------------------------------------

def _gguf_qtype(fmt: str):
    from gguf import GGMLQuantizationType, LlamaFileType

    return {"gguf-q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
            "gguf-q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
            "gguf-f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16)}[fmt]


def permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF's rotate-half row order → llama.cpp's interleaved one (as its converter does)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def encode_gguf(w: np.ndarray, qtype) -> np.ndarray:
    """A float32 [rows, cols] (or [experts, rows, cols]) array as the bytes of ``qtype`` (F16, or a
    block quantization done a few rows at a time so its numpy temporaries stay small); 1-D tensors,
    and any with ``qtype`` None, stay float32."""
    from gguf import GGMLQuantizationType, quants

    if w.ndim == 1 or qtype is None:
        return w
    if qtype == GGMLQuantizationType.F16:
        return w.astype(np.float16)
    rows = w.reshape(-1, w.shape[-1])
    out = np.empty(quants.quant_shape_to_byte_shape(rows.shape, qtype), dtype=np.uint8)
    step = max(1, QUANT_CHUNK_ELEMENTS // rows.shape[1])
    for start in range(0, rows.shape[0], step):
        out[start:start + step] = quants.quantize(rows[start:start + step], qtype)
    return out.reshape(quants.quant_shape_to_byte_shape(w.shape, qtype))


def _spec_qtype(spec: TensorSpec, qtype):
    """``qtype`` for a tensor ``encode_gguf`` encodes, None for one it leaves float32."""
    return None if len(spec.shape) == 1 or spec.keep_f32 else qtype


def _encoded_info(spec: TensorSpec, qtype) -> tuple[tuple[int, ...], np.dtype, int, object]:
    """(shape, numpy dtype, bytes, raw GGML type) of a tensor as ``encode_gguf`` will produce it."""
    from gguf import GGMLQuantizationType, quants

    if _spec_qtype(spec, qtype) is None:
        return spec.shape, np.dtype(np.float32), 4 * spec.numel, None
    if qtype == GGMLQuantizationType.F16:
        return spec.shape, np.dtype(np.float16), 2 * spec.numel, None
    byte_shape = quants.quant_shape_to_byte_shape(spec.shape, qtype)
    return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype


def _add_metadata(writer, shape: Shape, vocab_size: int) -> None:
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_vocab_size(vocab_size)
    writer.add_rope_dimension_count(shape.head_dim)


def _add_file_metadata(writer, file_type, fields) -> None:
    """The file type, quantization version and the tokenizer's ``fields`` (``tokenizer_fields``)."""
    from gguf import GGUFValueType

    writer.add_file_type(int(file_type))
    writer.add_quantization_version(2)
    for key, value, types in fields:
        if types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=types[-1])
        else:
            writer.add_key_value(key, value, types[0])


def _gguf_model(out: Path, shape_name: str, vocab_size: int, tiny: bool):
    """A GGUFWriter for ``out`` with the model's metadata, and the model's tensor plan: a Llama shape
    (``SHAPES``) or a family's (``FAMILY_SHAPES``, its keys written as loadtest.tools.hf_gguf writes them)."""
    import gguf

    from loadtest.tools import hf_gguf

    if shape_name in SHAPES:
        shape = SHAPES[shape_name]
        writer = gguf.GGUFWriter(out, "llama")
        writer.add_name(f"tandem synthetic {shape_name}")
        _add_metadata(writer, shape, vocab_size)
        return writer, tensor_plan(shape, vocab_size)
    cfg = family_config(shape_name, vocab_size, tiny)
    arch, _ = hf_gguf.gguf_arch(cfg)
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"tandem synthetic {shape_name}{' tiny' if tiny else ''}")
    hf_gguf.write_metadata(writer, cfg)
    return writer, family_plan(cfg)


def write_gguf(out: Path, shape_name: str, fmt: str, tok_path: Path, seed: int, tiny: bool = False) -> None:
    """Header, metadata and tensor index first (from the plan), then each tensor as it is made."""
    fields = tokenizer_fields(tok_path)
    qtype, file_type = _gguf_qtype(fmt)
    writer, plan = _gguf_model(out, shape_name, _vocab_size(fields), tiny)
    _add_file_metadata(writer, file_type, fields)
    for spec in plan:
        enc_shape, enc_dtype, nbytes, raw = _encoded_info(spec, qtype)
        writer.add_tensor_info(spec.gguf_name, enc_shape, enc_dtype, nbytes, raw_dtype=raw)
    writer.write_header_to_file(out)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with _progress(plan, out) as bar:
        for spec, w in random_weights(plan, seed):
            if spec.qk_heads:
                w = permute_qk(w, spec.qk_heads)
            writer.write_tensor_data(encode_gguf(w.numpy(), _spec_qtype(spec, qtype)))
            del w
            bar.update(spec.numel)
    writer.close()


# -- Hugging Face directory -------------------------------------------------------------------------

def _hf_config(shape: Shape, vocab_size: int, bos_id, eos_id) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "vocab_size": vocab_size, "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size, "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim, "hidden_act": "silu", "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta, "max_position_embeddings": shape.context_length,
        "tie_word_embeddings": shape.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "initializer_range": INIT_STD, "bos_token_id": bos_id, "eos_token_id": eos_id,
    }


def write_hf_tokenizer(out: Path, tok_path: Path) -> tuple[int | None, int | None]:
    """tokenizer.json (rebuilt from the GGUF's vocabulary as Tandem reads it) and
    tokenizer_config.json; returns the BOS and EOS ids."""
    from shared.tokenizer.gguf_vocab import build_backend, read_gguf_vocab

    vocab = read_gguf_vocab(tok_path)
    build_backend(vocab).save(str(out / "tokenizer.json"))
    config = {"bos_token": vocab.token(vocab.bos_token_id), "eos_token": vocab.token(vocab.eos_token_id),
              "unk_token": vocab.token(vocab.unk_token_id), "pad_token": vocab.token(vocab.pad_token_id),
              "add_bos_token": vocab.add_bos_token, "chat_template": vocab.chat_template,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return vocab.bos_token_id, vocab.eos_token_id


def _shards(plan: list[TensorSpec], bytes_per_param: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in plan:
        nbytes = spec.numel * bytes_per_param
        if shards[-1] and size + nbytes > HF_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def write_hf(out: Path, shape_name: str, tok_path: Path, seed: int) -> None:
    """config.json, tokenizer files and bfloat16 safetensors shards, one shard in memory at a time."""
    from safetensors.torch import save_file

    shape = SHAPES[shape_name]
    out.mkdir(parents=True, exist_ok=True)
    bos_id, eos_id = write_hf_tokenizer(out, tok_path)
    plan = tensor_plan(shape, _vocab_size(tokenizer_fields(tok_path)))
    (out / "config.json").write_text(json.dumps(_hf_config(shape, plan[0].shape[0], bos_id, eos_id), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id}))
    shards = _shards(plan, 2)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weights = random_weights(plan, seed)
    with _progress(plan, out) as bar:
        for name, shard in zip(names, shards):
            tensors = {}
            for spec in shard:
                _, w = next(weights)
                tensors[spec.hf_name] = w.to(torch.bfloat16)
                bar.update(spec.numel)
            save_file(tensors, str(out / name), metadata={"format": "pt"})
            del tensors
    index = {"metadata": {"total_size": 2 * sum(s.numel for s in plan)},
             "weight_map": {s.hf_name: name for name, shard in zip(names, shards) for s in shard}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_model(out: Path, shape_name: str, fmt: str, tokenizer_from: str = "smollm2-135m", seed: int = 0,
                tiny: bool = False) -> None:
    """``out`` in ``fmt``; ``tiny``: a family's shape at test size (``scaled_down``)."""
    if shape_name in FAMILY_SHAPES and fmt == "hf":
        raise SystemExit(f"--shape {shape_name}: the families are written as GGUF only")
    if tiny and shape_name not in FAMILY_SHAPES:
        raise SystemExit(f"--tiny scales a family's shape down, not {shape_name} (see the 'tiny' shape)")
    tok_path = tokenizer_gguf(tokenizer_from)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        write_hf(Path(out), shape_name, tok_path, seed)
    else:
        write_gguf(Path(out), shape_name, fmt, tok_path, seed, tiny)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m loadtest.tools.synth_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, choices=sorted(SHAPES) + sorted(FAMILY_SHAPES),
                   help="model shape (see above)")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="a .gguf file with 2-D weights in Q8_0, Q4_0 or F16, or a Hugging Face directory (hf)")
    p.add_argument("--out", required=True, type=Path, help="the .gguf file, or the directory for --format hf")
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same weights "
                                                       "in every format (default 0)")
    p.add_argument("--tokenizer-from", default="smollm2-135m",
                   help="GGUF file (or model alias) whose tokenizer.* metadata is copied; its vocabulary "
                        "sets the embedding size (default smollm2-135m, fetched into the cache if needed)")
    p.add_argument("--tiny", action="store_true", help="a family's shape at test size: hidden 64, 2 layers "
                                                        "(Gemma 3: 6), 4 heads of 16, 8 experts of 32")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.format != "hf" and args.out.suffix != ".gguf":
        raise SystemExit(f"--out {args.out}: a GGUF output path must end in .gguf")
    write_model(args.out, args.shape, args.format, args.tokenizer_from, args.seed, args.tiny)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
