"""loadtest.tools.synth_model: a tiny random model in every format loads in Tandem's loader and runs, the
formats agree, and loading a GGUF converts tensor by tensor instead of dequantizing all first; each other
family's shape, at test size, loads as that family and generates."""

from __future__ import annotations

import weakref

import pytest
import torch

from loadtest.tools import synth_model
from shared.model import loader
from shared.model.registry import resolve_model
from shared.tokenizer import Tokenizer
from shared.tokenizer.gguf_vocab import byte_to_unicode

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer_gguf(tmp_path_factory):
    """A GGUF with only a byte-level BPE tokenizer: 256 bytes, one merge, three special tokens."""
    from gguf import GGUFWriter

    path = tmp_path_factory.mktemp("tok") / "tokenizer.gguf"
    tokens = [*SPECIAL, *byte_to_unicode().values(), "th"]
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    writer.add_token_merges(["t h"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path, len(tokens)


@pytest.fixture(scope="module")
def synth(tokenizer_gguf, tmp_path_factory):
    """Path of the tiny model (seed 3) in each format, written through the command line."""
    out = tmp_path_factory.mktemp("synth")
    paths = {}
    for fmt in synth_model.FORMATS:
        path = out / ("tiny-hf" if fmt == "hf" else f"tiny-{fmt}.gguf")
        assert synth_model.main(["--shape", "tiny", "--format", fmt, "--out", str(path), "--seed", "3",
                                 "--tokenizer-from", str(tokenizer_gguf[0])]) == 0
        paths[fmt] = path
    return paths


def _load(path, dtype=torch.float32):
    source = resolve_model(str(path))
    return source, loader.load_model(source.path, source.format, torch.device("cpu"), dtype)


PROMPT = [5, 70, 71, 72, 1, 100, 200, 201, 33, 2, 9, 90]


@pytest.mark.parametrize("fmt", synth_model.FORMATS)
def test_each_format_loads_with_the_shape_and_runs(synth, tokenizer_gguf, fmt):
    shape, vocab = synth_model.SHAPES["tiny"], tokenizer_gguf[1]
    source, model = _load(synth[fmt])
    assert source.format == ("hf" if fmt == "hf" else "gguf")
    cfg = model.cfg
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.intermediate_size, cfg.rope_theta, cfg.tie_word_embeddings, cfg.max_position_embeddings) == (
        "llama", vocab, shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads,
        shape.intermediate_size, shape.rope_theta, shape.tie_word_embeddings, shape.context_length)
    assert model.embed.shape == (vocab, shape.hidden_size)
    assert model.layers[0].qkv.shape == ((shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim,
                                         shape.hidden_size)
    logits = model.prefill_logits(PROMPT)
    assert logits.shape == (len(PROMPT), vocab) and torch.isfinite(logits).all()
    assert 0.05 < float(logits.std()) < 5  # std-0.02 weights: neither collapsed nor blown up
    tok = Tokenizer.from_model_files(source.path, source.format)
    assert tok.vocab_size == vocab and tok.eos_token_id == 2
    assert tok.decode(tok.encode("the cat")) == "the cat"


def test_same_seed_same_model_in_every_format(synth):
    """Q/K are permuted for llama.cpp in a GGUF and not in HF: the loader undoes it, so all agree."""
    ref = _load(synth["gguf-f16"])[1].prefill_logits(PROMPT)
    for fmt, tol in (("hf", 0.02), ("gguf-q8_0", 0.02), ("gguf-q4_0", 0.25)):
        got = _load(synth[fmt])[1].prefill_logits(PROMPT)
        assert (got - ref).abs().max() < tol, fmt


@pytest.mark.parametrize("fmt", ["gguf-q8_0", "hf"])
def test_loading_converts_each_tensor_before_reading_the_next(synth, monkeypatch, fmt):
    """Every float32 tensor read is gone (converted to bfloat16) before the next one is read."""
    alive: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
    max_alive = 0

    def track(tensor):
        nonlocal max_alive
        if tensor.dtype == torch.float32:
            alive.add(tensor)
        max_alive = max(max_alive, len(alive))
        return tensor

    if fmt == "hf":  # the files hold bfloat16: read them as float32, as a float32 checkpoint would be
        from safetensors import safe_open

        class Float32Reader:
            def __init__(self, *args, **kwargs):
                self._f = safe_open(*args, **kwargs)

            def __enter__(self):
                self._f.__enter__()
                return self

            def __exit__(self, *exc):
                return self._f.__exit__(*exc)

            def keys(self):
                return self._f.keys()

            def get_tensor(self, name):
                return track(self._f.get_tensor(name).float())

        monkeypatch.setattr("safetensors.safe_open", Float32Reader)  # the loader imports it when it runs
    else:
        dequantize = loader._dequantize
        monkeypatch.setattr(loader, "_dequantize", lambda t: track(dequantize(t)))
    model = _load(synth[fmt], torch.bfloat16)[1]
    assert model.dtype == torch.bfloat16 and model.layers[0].qkv.dtype == torch.bfloat16
    assert max_alive == 1, f"{max_alive} float32 tensors alive at once while loading"


# the architecture Tandem reads back from each family's GGUF (general.architecture → a FAMILIES key)
FAMILY_ARCHITECTURES = {"qwen3-1.7b": "qwen3", "gemma3-1b": "gemma3_text", "olmo2-1b": "olmo2",
                        "granite-2b": "granite", "qwen3-moe-a1b": "qwen3_moe"}


def test_every_family_shape_is_checked_here():
    assert set(FAMILY_ARCHITECTURES) == set(synth_model.FAMILY_SHAPES)


@pytest.mark.parametrize("name", sorted(FAMILY_ARCHITECTURES))
def test_a_family_shape_at_test_size_loads_as_its_family_and_generates(name, tokenizer_gguf, tmp_path):
    """``--tiny``: the family's GGUF, read back by Tandem's loader as that family with the shape it was
    written with (window, experts and multipliers included), serves greedy tokens through the engine."""
    from gguf import GGUFReader

    from shared.engine import EngineConfig, LLMEngine, SamplingParams

    path = tmp_path / f"{name}.gguf"
    assert synth_model.main(["--shape", name, "--format", "gguf-q8_0", "--out", str(path), "--tiny",
                             "--tokenizer-from", str(tokenizer_gguf[0])]) == 0
    want = synth_model.family_config(name, tokenizer_gguf[1], tiny=True)
    arch = GGUFReader(str(path)).fields["general.architecture"].contents()
    assert arch == {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe"}.get(want["model_type"], want["model_type"])
    model = _load(path)[1]
    cfg = model.cfg
    assert cfg.architecture == FAMILY_ARCHITECTURES[name] == want["model_type"]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.tie_word_embeddings) == (
        tokenizer_gguf[1], 64, want["num_hidden_layers"], 4, want["num_key_value_heads"], 16,
        want["tie_word_embeddings"])
    if name == "gemma3-1b":  # windows of 8 in layers 0-4, layer 5 global
        assert (cfg.sliding_window, cfg.window_layers, cfg.activation) == (8, (0, 1, 2, 3, 4), "gelu_tanh")
    if name == "qwen3-moe-a1b":
        assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size, cfg.moe.layers) == (8, 2, 32, (0, 1))
    if name == "granite-2b":
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == pytest.approx(
            (12.0, 0.22, 8.0))
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=8))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = engine.generate([PROMPT, PROMPT[:5]], params)
    assert [len(tokens) for tokens in out] == [4, 4]
    assert all(0 <= t < tokenizer_gguf[1] for tokens in out for t in tokens)
    assert out[0] == engine.generate([PROMPT], params)[0]  # greedy: the same tokens again


def test_the_full_size_families_have_the_parameters_their_docstring_states():
    """The plans at full size (no file written): the counts the module docstring gives, the MoE's active part."""
    counts = {}
    for name in synth_model.FAMILY_SHAPES:
        cfg = synth_model.family_config(name, 49152)
        plan = synth_model.family_plan(cfg)
        total = sum(s.numel for s in plan)
        experts = sum(s.numel for s in plan if ".experts." in s.hf_name)
        active = total - experts + experts * cfg.get("num_experts_per_tok", 1) // cfg.get("num_experts", 1)
        counts[name] = (round(total / 1e9, 2), round(active / 1e9, 2))
    assert counts == {"qwen3-1.7b": (1.51, 1.51), "gemma3-1b": (0.75, 0.75), "olmo2-1b": (1.28, 1.28),
                      "granite-2b": (2.53, 2.53), "qwen3-moe-a1b": (2.92, 1.11)}
    routers = [s for s in synth_model.family_plan(synth_model.family_config("qwen3-moe-a1b", 49152))
               if s.gguf_name.endswith("ffn_gate_inp.weight")]
    assert len(routers) == 16 and all(s.keep_f32 for s in routers)


def test_a_family_is_written_as_gguf_only(tokenizer_gguf, tmp_path):
    with pytest.raises(SystemExit, match="GGUF only"):
        synth_model.write_model(tmp_path / "hf", "qwen3-1.7b", "hf", str(tokenizer_gguf[0]))
    with pytest.raises(SystemExit, match="--tiny"):
        synth_model.write_model(tmp_path / "x.gguf", "llama-1b", "gguf-q8_0", str(tokenizer_gguf[0]), tiny=True)
