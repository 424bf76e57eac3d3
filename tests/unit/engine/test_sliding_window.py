"""Sliding-window attention against transformers: tiny random-weight models whose window (12 tokens)
the prompts and generations run far past, through one prefill, prefill chunks that straddle the
window, decode steps and the engine (chunked prefill beside decodes, paged blocks of 8)."""

import dataclasses

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.kvcache.layout import KvCacheSpec
from shared.model.attention import AttentionMetadata, TorchAttentionBackend
from shared.model.config import ModelConfig
from shared.model.loader import load_model
from test_model_vs_transformers import assert_greedy_under_hf
from tiny_hf_models import SLIDING_WINDOW, save_tiny

# every layer windowed (Mistral; Mixtral, with experts; Phi-3), windowed layers after a global one (Qwen3's
# max_window_layers), SmolLM3's layer without rotary, windowed and global layers interleaved (Gemma 2:
# soft-capped; Gemma 3: its own rope base)
WINDOWED = {"mistral": (0, 1), "mixtral_window": (0, 1), "phi3_window": (0, 1), "qwen3_window": (1,),
            "smollm3_window": (0,), "gemma2": (0,), "gemma3_text": (0, 2)}


@pytest.fixture(scope="module", params=list(WINDOWED))
def windowed_hf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_tiny(request.param, path)


def prompt_of(n: int, k: int = 0) -> list[int]:
    return [(13 * i + 5 + k) % 256 for i in range(n)]


def test_windowed_layers_are_those_transformers_windows(windowed_hf):
    kind, path, hf = windowed_hf
    model = load_model(path, "hf", torch.device("cpu"), torch.float32)
    assert model.cfg.sliding_window == SLIDING_WINDOW and model.cfg.window_layers == WINDOWED[kind]
    assert model.cfg.max_position_embeddings == hf.config.max_position_embeddings  # the context is not cut
    types = getattr(hf.config, "layer_types", None)
    if kind in ("mistral", "mixtral_window", "phi3_window"):  # no layer types: every layer's mask is windowed
        assert hf.config.sliding_window == SLIDING_WINDOW
    else:
        assert tuple(i for i, t in enumerate(types) if t == "sliding_attention") == WINDOWED[kind]


def test_every_positions_logits_match_past_the_window(windowed_hf):
    _, path, hf = windowed_hf
    model = load_model(path, "hf", torch.device("cpu"), torch.float32)
    prompt = prompt_of(48)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(model.prefill_logits(prompt), ref, rtol=1e-4, atol=1e-4)


def stepped_logits(model, tokens: list[int], steps: list[int], block_size: int = 4) -> torch.Tensor:
    """Float32 logits [n, V] at every position of ``tokens``, run as steps of ``steps[i]`` tokens each
    over one scratch paged cache: a step of one token after the first is a decode row, the others
    prefill chunks over the cached prefix."""
    n, dev = len(tokens), model.device
    assert sum(steps) == n
    num_blocks = -(-n // block_size)
    kv = KvCacheSpec(len(model.layers), model.num_kv_heads, model.cfg.head_dim, block_size,
                     model.dtype).allocate(num_blocks + 1, dev)
    # blocks in reverse order: a position's block is never its neighbour's by accident
    table = torch.arange(num_blocks, 0, -1, dtype=torch.int32, device=dev)[None]
    slots = torch.tensor([int(table[0, p // block_size]) * block_size + p % block_size for p in range(n)])
    logits, lo = [], 0
    for size in steps:
        hi = lo + size
        meta = AttentionMetadata(
            num_decodes=1 if size == 1 and lo else 0, slot_mapping=slots[lo:hi], block_tables=table,
            seq_lens=torch.tensor([hi], dtype=torch.int32), query_start_loc=torch.tensor([0, size], dtype=torch.int32),
            max_seq_len=hi, max_query_len=size)
        hidden = model.forward(torch.tensor(tokens[lo:hi]), torch.arange(lo, hi), kv, meta, TorchAttentionBackend())
        logits.append(model.compute_logits(hidden))
        lo = hi
    return torch.cat(logits)


def test_chunks_straddling_the_window_and_decode_steps_past_it_match(windowed_hf):
    """Chunks of 7 and 10 tokens, whose queries' windows begin in an earlier chunk (and in the
    middle of a block of 4), then a decode step per token up to three windows past the prompt."""
    _, path, hf = windowed_hf
    model = load_model(path, "hf", torch.device("cpu"), torch.float32)
    tokens = prompt_of(60, 3)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    got = stepped_logits(model, tokens, [7, 10, 10] + [1] * 33)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_how_a_prompt_is_chunked_moves_no_bit_past_the_window(windowed_hf):
    """The prefill reference's tiles see the same keys whatever chunk their queries came in, the
    window's first key included (docs/engine.md, "Batch-invariant attention")."""
    kind, path, _ = windowed_hf
    if kind == "mixtral_window":
        pytest.skip("an expert's product runs over the tokens the chunk routes to it: its bits move without a window")
    if kind == "gemma2":
        pytest.skip("the soft-capped attention runs a chunk's queries in one product: its bits move without a window")
    model = load_model(path, "hf", torch.device("cpu"), torch.float32)
    tokens = prompt_of(150, 5)
    whole = stepped_logits(model, tokens, [150])
    assert torch.equal(stepped_logits(model, tokens, [7, 10, 70, 63]), whole)


def test_engine_greedy_past_the_window_matches_transformers(windowed_hf):
    """Chunked prefill (24 tokens a step) beside decodes, blocks of 8; prompts shorter and longer
    than the window, each generating two windows past its end."""
    _, path, hf = windowed_hf
    model = load_model(path, "hf", torch.device("cpu"), torch.float32)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=24))
    prompts = [prompt_of(n, k) for k, n in ((1, 5), (2, 41), (3, 70))]
    params = SamplingParams(max_tokens=2 * SLIDING_WINDOW, temperature=0.0, ignore_eos=True)
    got = engine.generate(prompts, params)
    for prompt, generated in zip(prompts, got):
        assert len(generated) == 2 * SLIDING_WINDOW
        assert_greedy_under_hf(hf, prompt, generated)
    assert engine.kv.pool.num_free_blocks == engine.num_blocks


def test_a_prefix_hit_past_the_window_matches_transformers(windowed_hf):
    """A second prompt sharing 40 tokens (5 blocks of 8, more than three windows) with a finished
    one reads their cached K/V and attends over its window of them."""
    _, path, hf = windowed_hf
    model = load_model(path, "hf", torch.device("cpu"), torch.float32)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=8))
    params = SamplingParams(max_tokens=SLIDING_WINDOW, temperature=0.0, ignore_eos=True)
    first = prompt_of(45, 4)
    engine.generate([first], params)
    second = first[:40] + prompt_of(9, 9)
    engine.add_request("hit", second, params)
    generated, cached = [], None
    while cached is None or len(generated) < SLIDING_WINDOW:
        for out in engine.step():
            generated += out.new_token_ids
            cached = out.num_cached_tokens
    assert cached == 40
    assert_greedy_under_hf(hf, second, generated)


def test_blocks_out_of_every_layers_window_go_back_to_the_pool(windowed_hf):
    """A prompt of 41 and 60 tokens out, blocks of 8, 24 tokens a step: where every layer is windowed
    (12) the request never holds more than the blocks its window and a step span, and its text is
    still transformers'; where a layer sees the whole context, it holds all 13 blocks by its end."""
    kind, path, hf = windowed_hf
    model = load_model(path, "hf", torch.device("cpu"), torch.float32)
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=24))
    prompt = prompt_of(41, 6)
    engine.add_request("r", prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    generated, most_held = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated += out.new_token_ids
        most_held = max(most_held, engine.num_blocks - engine.kv.pool.num_free_blocks)
        engine.kv.check_integrity()
    assert_greedy_under_hf(hf, prompt, generated)
    windowed_throughout = len(WINDOWED[kind]) == model.cfg.num_layers
    assert (model.cfg.uniform_window == SLIDING_WINDOW) == windowed_throughout
    # a step of 24 tokens from position p sees p - 11 .. p + 23: 35 positions, at most 6 blocks of 8
    assert most_held <= 6 if windowed_throughout else most_held == engine.kv.blocks_for(41 + 60)
    assert engine.kv.pool.num_free_blocks == engine.num_blocks


# config.json as transformers 4 and hub checkpoints write them: no layer_types, the family's rule decides
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4)


@pytest.mark.parametrize("fields, window, layers", [
    (dict(model_type="mistral", sliding_window=4096), 4096, (0, 1, 2, 3, 4, 5)),
    (dict(model_type="mistral", sliding_window=None), None, ()),
    (dict(model_type="qwen2", sliding_window=32, use_sliding_window=True, max_window_layers=4), 32, (4, 5)),
    (dict(model_type="qwen3", sliding_window=32, max_window_layers=0), None, ()),  # the switch is off by default
    (dict(model_type="smollm3", sliding_window=32, use_sliding_window=True), 32, (3,)),  # its layers without rope
    (dict(model_type="gemma2", sliding_window=32), 32, (0, 2, 4)),
    (dict(model_type="gemma3_text", sliding_window=32, sliding_window_pattern=3), 32, (0, 1, 3, 4)),
    (dict(model_type="gemma3_text", sliding_window=32, layer_types=["full_attention"] * 5 + ["sliding_attention"]),
     32, (5,)),
    (dict(model_type="qwen3_moe", sliding_window=32, use_sliding_window=True, num_experts=4, num_experts_per_tok=2,
          moe_intermediate_size=32), 32, (0, 1, 2, 3, 4, 5)),
    (dict(model_type="llama", sliding_window=32), None, ()),  # Llama has no window
])
def test_which_layers_a_config_windows(fields, window, layers):
    cfg = ModelConfig.from_hf(BASE | fields)
    assert (cfg.sliding_window, cfg.window_layers) == (window, layers)
    assert [cfg.layer_window(i) for i in range(6)] == [window if i in layers else None for i in range(6)]


@pytest.mark.parametrize("kind, config", [
    ("qwen2", "Qwen2Config"), ("qwen3", "Qwen3Config"), ("smollm3", "SmolLM3Config"), ("gemma2", "Gemma2Config"),
    ("gemma3_text", "Gemma3TextConfig")])
def test_the_layer_rule_without_layer_types_is_transformers_own(kind, config):
    """Each family's rule for a config.json without layer_types gives the layer types transformers
    derives from the same fields."""
    import transformers

    fields = dict(BASE, num_hidden_layers=8, sliding_window=32, use_sliding_window=True, max_window_layers=3,
                  sliding_window_pattern=3, no_rope_layers=[1, 0, 1, 1, 0, 1, 1, 0])
    hf = getattr(transformers, config)(**fields)
    want = tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention")
    assert want, "a rule that windows nothing checks nothing"
    assert ModelConfig.from_hf(dict(fields, model_type=kind)).window_layers == want


def test_a_window_without_a_positive_size_is_refused():
    cfg = ModelConfig.from_hf(BASE | dict(model_type="mistral", sliding_window=8))
    with pytest.raises(ValueError, match="positive sliding_window"):
        dataclasses.replace(cfg, sliding_window=0)


def test_the_compiled_decode_step_refuses_windowed_layers_beside_global_ones(tmp_path):
    """One window for every layer is a mask of the past the compiled step takes (below); a model
    whose windowed layers sit beside global ones decodes eagerly under compile on."""
    from shared.engine.compiled.step import CompiledDecode

    save_tiny("qwen3_window", tmp_path)
    model = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="windowed layers beside global ones"):
        CompiledDecode(model, 4)


def test_the_compiled_decode_step_of_a_model_windowed_throughout_gives_the_eager_tokens(tmp_path):
    """Mistral with a window of 12 on every layer: prompts of 30 and 41 tokens decoding 20 more, the
    graph's past masked to the window, equal to the eager engine's greedy tokens."""
    from shared.engine import EngineConfig, LLMEngine, SamplingParams

    save_tiny("mistral", tmp_path)
    model = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + 13 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((30, 41))]
    eager = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=4))
    compiled = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=4, compile="on"))
    assert compiled.generate(prompts, greedy) == eager.generate(prompts, greedy)
    assert compiled.runner.compiled.num_steps > 0
