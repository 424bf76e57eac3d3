"""The compiled decode step (shared/engine/compiled/step.py) on a tiny model: the same greedy tokens as
the eager step for ragged batches, with NaN in every unused cache slot; only decode-only steps
go through the graph; no recompilation after warm-up."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.model.attention import AttentionMetadata
from shared.engine.compiled.step import CompiledDecode


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(n)]  # 5, 14, 23, ... tokens


@pytest.fixture(scope="module")
def engines(tiny_engine_model):
    eager = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=4))
    compiled = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=4, compile=True))
    for engine in (eager, compiled):
        engine.kv_cache.fill_(float("nan"))  # what a slot holds before its token is written must not matter
    return eager, compiled


@pytest.mark.parametrize("num_requests", [1, 3])
def test_compiled_decode_gives_the_eager_greedy_tokens(engines, num_requests):
    eager, compiled = engines
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    before = compiled.runner.compiled.num_steps
    expected = eager.generate(prompts(num_requests), greedy)
    assert compiled.generate(prompts(num_requests), greedy) == expected
    # every step after each prompt's first token went through the graph (at least 11 of them)
    assert compiled.runner.compiled.num_steps - before >= 11
    compiled.kv.check_integrity()


def test_no_recompilation_after_warm_up(engines):
    import torch._dynamo.utils

    _, compiled = engines
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled.generate(prompts(2), greedy)  # batch 2, other lengths than warm-up's
    compiled.generate(prompts(4), greedy)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


def test_only_decode_rows_run_compiled(engines):
    """A step's decode rows go through the compiled step, first, a speculative entry's tokens
    (1 token + 3 drafts) among them as rows of their own; then the eager decode rows (a prompt's
    last token computed alone), then a prefill chunk."""
    from shared.engine.request import Request
    from shared.engine.scheduler import ScheduledRequest, SchedulerOutput

    _, compiled = engines

    def request(request_id: str, num_prompt: int, num_output: int = 0) -> Request:
        r = Request(request_id, list(range(3, 3 + num_prompt)), SamplingParams(temperature=0.0))
        r.output_token_ids = [5] * num_output
        return r

    decode = ScheduledRequest(request("decode", 5, 2), 1, [1, 2], 6)
    chunk = ScheduledRequest(request("chunk", 20), 8, [3, 4, 5, 13], 8)
    last = ScheduledRequest(request("last", 20), 1, [6, 7, 8, 9, 10], 19)
    draft = ScheduledRequest(request("draft", 5, 2), 4, [11, 12, 14], 6, draft=[7, 8, 9])
    order = compiled.runner.split(SchedulerOutput([last, chunk, decode, draft]))
    out = order.out
    assert [s.request.request_id for s in out.scheduled] == ["decode", "draft", "last", "chunk"]
    assert order.num_decode_entries == 3 and order.num_compiled_entries == 2
    assert order.num_compiled_rows == 1 + 4
    assert decode.request.decode_path == "compiled" == draft.request.decode_path
    _, _, meta, logits_rows = compiled.runner.prepare(out, order.num_decode_entries)
    assert meta.num_decodes == 6 and meta.seq_lens.tolist() == [7, 7, 8, 9, 10, 20, 16]
    assert meta.step_starts.tolist() == [6, 6, 6, 6, 6, 19]
    assert logits_rows == [0, 1, 2, 3, 4, 5]  # the chunk does not reach its last token


def test_background_compile_serves_eagerly_then_switches(tiny_engine_model, engines, caplog):
    """``compile="background"``: the engine answers at once (eager steps) while a thread compiles;
    once the graph is handed over, decode-only steps run it, and the greedy tokens are eager's."""
    import torch._dynamo.utils

    eager, _ = engines
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with caplog.at_level("INFO", logger="shared.engine.compiled.background"):
        engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=4,
                                                           compile="background"))
        assert engine.generate(prompts(2), greedy) == eager.generate(prompts(2), greedy)
        assert engine.background_compile.wait(timeout=600)
    assert engine.background_compile.error is None
    assert engine.runner.compiled is not None
    graphs, steps = torch._dynamo.utils.counters["stats"]["unique_graphs"], engine.runner.compiled.num_steps
    assert engine.generate(prompts(3), greedy) == eager.generate(prompts(3), greedy)
    assert engine.generate(prompts(1), greedy) == eager.generate(prompts(1), greedy)
    assert engine.runner.compiled.num_steps - steps >= 14
    # the graphs compiled on the other thread serve this one as they are (its guards hold here)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert "compiled decode step ready after" in caplog.text


def test_a_failed_background_compile_leaves_the_eager_step(tiny_engine_model, monkeypatch, caplog):
    def broken(self, kv_cache, *artifacts, **options):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(CompiledDecode, "warm", broken)
    with caplog.at_level("WARNING", logger="shared.engine.compiled.background"):
        engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=4,
                                                           compile="background"))
        assert engine.background_compile.wait(timeout=60)
    assert isinstance(engine.background_compile.error, RuntimeError)
    assert engine.runner.compiled is None
    assert "decode steps stay eager: RuntimeError: no C++ compiler" in caplog.text
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert [len(t) for t in engine.generate(prompts(2), greedy)] == [4, 4]


def test_compile_modes():
    assert EngineConfig(compile=True).compile == "on" and EngineConfig().compile == "off"
    assert EngineConfig(compile="Background").compile == "background"
    with pytest.raises(ValueError, match="unknown compile mode 'fast'"):
        EngineConfig(compile="fast")


@pytest.mark.parametrize("lengths", [[5, 0, 12], [16]])
def test_written_out_attention_matches_sdpa_over_past_and_own_token(lengths):
    """The graph's attention (shared/engine/compiled/step.py ``_decode_attention``), run eagerly: the
    softmax over a sequence's cached past (NaN in every slot past its length) and its own token
    equals SDPA over the concatenated valid positions, with 3 query heads per KV head."""
    from shared.engine.compiled.step import _decode_attention

    torch.manual_seed(0)
    num_seqs, past_len, heads, kv_heads, dim = len(lengths), 16, 6, 2, 8
    q = torch.randn(num_seqs, heads, dim)
    k, v = torch.randn(num_seqs, kv_heads, dim), torch.randn(num_seqs, kv_heads, dim)
    past_k, past_v = torch.randn(num_seqs, past_len, kv_heads, dim), torch.randn(num_seqs, past_len, kv_heads, dim)
    valid = torch.arange(past_len)[None, :] < torch.tensor(lengths)[:, None]
    past_k[~valid], past_v[~valid] = float("nan"), float("nan")
    got = _decode_attention(q, k, v, past_k, past_v, valid[:, :, None, None])
    for b, n in enumerate(lengths):
        keys = torch.cat([past_k[b, :n], k[b, None]]).repeat_interleave(heads // kv_heads, dim=1)  # [n + 1, H, D]
        values = torch.cat([past_v[b, :n], v[b, None]]).repeat_interleave(heads // kv_heads, dim=1)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b][:, None], keys.transpose(0, 1), values.transpose(0, 1))[:, 0]
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-6)


def test_background_graphs_fit_the_async_engine_thread(tiny_engine_model, monkeypatch):
    """As in a worker: an AsyncEngine's thread steps while another thread compiles, and the thread
    that built the engine gives its intra-op threads up. The compiled graphs must fit the engine
    thread as they are (dynamo guards on the thread count): no compile again, no eager fallback."""
    import asyncio

    from shared.engine.async_engine import AsyncEngine

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=4, compile="background"))
    aengine = AsyncEngine(engine)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def answer(request_id: str, prompt: list[int]) -> list[int]:
        return [t async for out in aengine.generate(request_id, prompt, greedy) for t in out.new_token_ids]

    try:
        assert engine.background_compile.wait(timeout=600) and engine.background_compile.error is None
        assert aengine.stats().decode_step == "compiled"
        for i, prompt in enumerate(prompts(3)):
            assert len(asyncio.run(answer(f"r{i}", prompt))) == 8  # a recompile would have killed the engine
        assert engine.runner.compiled.num_steps >= 21
    finally:
        aengine.shutdown()
        torch.set_num_threads(before)


def test_two_models_in_one_process_each_run_their_own_graph(tmp_path):
    """The graphs' guards leave the model out (its weights and layers never change), so each
    CompiledDecode must keep its graphs apart: a second model, here one of fewer layers, runs a
    graph of its own, not the first one's."""
    from shared.model.loader import load_model
    from tiny_hf_models import save_tiny

    save_tiny("llama", tmp_path)
    models = [load_model(tmp_path, "hf", torch.device("cpu"), torch.float32) for _ in range(2)]
    models[1].layers = models[1].layers[:1]  # another model: its first layer only
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = []
    for model in models:
        eager = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=4))
        compiled = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=4, compile="on"))
        expected = eager.generate(prompts(2), greedy)
        assert compiled.generate(prompts(2), greedy) == expected
        outputs.append(expected)
    assert outputs[0] != outputs[1]


def test_qwen3_compiled_decode_gives_the_eager_tokens(tmp_path):
    """The graph calls the layer's own q/k hook (``LlamaLayer.norm_qk``), so Qwen3's per-head
    norms run in it as in the eager step."""
    from shared.model.loader import load_model
    from tiny_hf_models import save_tiny

    save_tiny("qwen3", tmp_path)
    model = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eager = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=4))
    compiled = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=4, compile="on"))
    assert compiled.generate(prompts(2), greedy) == eager.generate(prompts(2), greedy)
    assert compiled.runner.compiled.num_steps > 0


@pytest.mark.parametrize("kind,differs", [("olmo2", "post-norms"), ("granite", "multipliers"),
                                          ("gemma2", "soft-capping"), ("gemma3_text", "local layers")])
def test_families_the_compiled_step_does_not_cover_decode_eagerly(tmp_path, kind, differs, caplog):
    """OLMo 2, Granite and the Gemmas: compile on gives the eager engine (and says why), and the
    compiled step refuses the model rather than run the Llama layer on it."""
    import logging

    from shared.engine.compiled.step import CompiledDecode
    from shared.model.loader import load_model
    from tiny_hf_models import save_tiny

    save_tiny(kind, tmp_path)
    model = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=differs):
        CompiledDecode(model, 4)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eager = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=4))
    with caplog.at_level(logging.INFO, logger="shared.engine.build"):
        asked = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=4, compile="on"))
    assert asked.runner.compiled is None and "decode steps run eagerly" in caplog.text
    assert asked.generate(prompts(2), greedy) == eager.generate(prompts(2), greedy)


@pytest.mark.parametrize("method", ["int8", "int8-precise", "gguf"])
def test_a_row_gets_the_same_bits_alone_and_among_any_batch_mates(tmp_path, method):
    """One graph serves every batch (a lone sequence runs beside a companion row), so with int8
    layers (exact int32 sums per row) or gguf's blocks (kernels/blocks_cpu.py computes each row
    by the same instructions) a sequence's hidden state is bit for bit the same alone, first or last among others.
    (float32 matmuls are not: their kernels change with the number of rows.) Each method compiles
    its own graph, which takes over a minute on a 2-core CPU."""
    from shared.model.loader import load_model
    from tiny_hf_models import save_tiny

    save_tiny("llama", tmp_path)
    model = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32)
    model.quantize(method, list(range(3, 60)))
    assert model.quantization == method
    compiled = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=4, compile="on",
                                             quantization=method))
    step = compiled.runner.compiled
    torch.manual_seed(1)
    pool = torch.randn_like(compiled.kv_cache)
    bs = step.block_size
    # (token, length with the new token, the sequence's blocks)
    seqs = {"a": (5, 14, [1, 2, 3, 4]), "b": (9, 7, [5, 6]), "c": (11, 19, [7, 8, 9, 10, 11]), "d": (3, 2, [12])}

    def run(names: list[str]) -> dict[str, torch.Tensor]:
        rows = [seqs[n] for n in names]
        width = max(len(r[2]) for r in rows)
        meta = AttentionMetadata(
            num_decodes=len(rows),
            slot_mapping=torch.tensor([r[2][(r[1] - 1) // bs] * bs + (r[1] - 1) % bs for r in rows]),
            block_tables=torch.tensor([r[2] + [0] * (width - len(r[2])) for r in rows], dtype=torch.int32),
            seq_lens=torch.tensor([r[1] for r in rows], dtype=torch.int32),
            query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32), max_seq_len=max(r[1] for r in rows),
            max_query_len=1)
        hidden = step.forward(torch.tensor([r[0] for r in rows]), torch.tensor([r[1] - 1 for r in rows]), pool, meta)
        return dict(zip(names, hidden))

    alone = {name: run([name])[name] for name in seqs}
    for batch in (["a", "b"], ["b", "a"], ["c", "a", "d"], ["d", "c", "b", "a"], ["a", "a", "b", "c", "d"]):
        for name, row in run(batch).items():
            assert torch.equal(row, alone[name]), (name, batch)


def test_decode_rows_stay_compiled_while_another_request_prefills(tmp_path):
    """A step that prefills one request and decodes another runs the decode rows through the
    compiled step and the prefill eagerly: the decoding request's log-probabilities are bit for bit
    those it gets alone (int8 layers), however the other's prompt is cut into chunks beside it."""
    from shared.model.loader import load_model
    from tiny_hf_models import save_tiny

    save_tiny("llama", tmp_path)
    model = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32)
    model.quantize("int8", list(range(3, 60)))
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=4 << 20, block_size=4, compile="on", quantization="int8",
                                           max_num_batched_tokens=16, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    prompt, long_prompt = prompts(2)[1], [(11 * j) % 250 + 3 for j in range(120)]

    def decode(request_id: str, beside: list[int] | None) -> list[float]:
        engine.add_request(request_id, prompt, params)
        logprobs: list[float] = []
        while engine.has_unfinished_requests():
            if beside is not None and len(logprobs) == 2:  # a long prompt arrives while it decodes
                engine.add_request(request_id + "-beside", beside, SamplingParams(max_tokens=2, ignore_eos=True))
                beside = None
            for out in engine.step():
                if out.request_id == request_id:
                    logprobs.extend(lp.logprob for lp in out.logprobs or ())
        return logprobs

    alone = decode("alone", None)
    steps = engine.runner.compiled.num_steps
    beside = decode("beside", long_prompt)
    assert len(alone) == 12 and beside == alone
    # every one of its tokens after the first came from the compiled step, prefill steps included
    assert engine.runner.compiled.num_steps - steps >= 11


def test_a_request_keeps_the_path_it_started_decoding_on(tmp_path):
    """When the compiled step is handed over (the background compile), a request already decoding
    eagerly finishes eagerly, bit for bit as on an engine that never compiles (int8 layers); one
    that starts decoding afterwards runs compiled."""
    from shared.engine.compiled.artifacts import CompileArtifacts, engine_artifact_key
    from shared.model.loader import load_model
    from tiny_hf_models import save_tiny

    save_tiny("llama", tmp_path)
    model = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32)
    model.quantize("int8", list(range(3, 60)))
    config = EngineConfig(kv_cache_memory=4 << 20, block_size=4, quantization="int8", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    prompt = prompts(2)[1]

    def logprobs(engine, request_id: str, hand_over_after: int | None = None) -> list[float]:
        engine.add_request(request_id, prompt, params)
        got: list[float] = []
        while engine.has_unfinished_requests():
            if hand_over_after is not None and len(got) == hand_over_after:
                compiled = CompiledDecode(model, 4)
                compiled.warm(engine.kv_cache, CompileArtifacts(CompileArtifacts.default_root(),
                                                                engine_artifact_key(model, 4, compiled.threads)))
                engine.runner.use_compiled(compiled)
            for out in engine.step():
                got.extend(lp.logprob for lp in out.logprobs or ())
        return got

    eager_only = logprobs(LLMEngine(model, config), "eager")
    engine = LLMEngine(model, config)
    assert logprobs(engine, "across", hand_over_after=3) == eager_only
    assert engine.runner.compiled.num_steps == 0
    after = logprobs(engine, "after")  # started once the compiled step was there: compiled throughout
    assert engine.runner.compiled.num_steps >= 9 and len(after) == 10


@pytest.mark.parametrize("compile_mode", ["off", "on"])
def test_a_moved_greedy_request_continues_with_the_same_bits(tmp_path, compile_mode):
    """A greedy request that moves to another engine after some tokens (its prompt then ends with
    them, ``num_output_in_prompt``) recomputes them as decode rows, as they were first computed,
    not as a prefill: its continuation has the same tokens and log-probabilities, bit for bit, as
    if it had not moved (int8 layers; eager and compiled steps)."""
    from shared.model.loader import load_model
    from tiny_hf_models import save_tiny

    save_tiny("llama", tmp_path)
    model = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32)
    model.quantize("int8", list(range(3, 60)))
    config = EngineConfig(kv_cache_memory=4 << 20, block_size=4, quantization="int8", compile=compile_mode,
                          max_num_batched_tokens=16)
    prompt = prompts(3)[2]

    def run(engine, request_id: str, tokens: list[int], params: SamplingParams) -> tuple[list[int], list[float]]:
        engine.add_request(request_id, tokens, params)
        ids, logprobs = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                ids.extend(out.new_token_ids)
                logprobs.extend(lp.logprob for lp in out.logprobs or ())
        return ids, logprobs

    ids, logprobs = run(LLMEngine(model, config), "first", prompt,
                        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0))
    for moved_after in (1, 6, 11):
        other = LLMEngine(model, config)  # another worker, with the same step
        rest = run(other, f"moved-{moved_after}", prompt + ids[:moved_after],
                   SamplingParams(max_tokens=16 - moved_after, temperature=0.0, ignore_eos=True, logprobs=0,
                                  num_output_in_prompt=moved_after))
        assert rest == (ids[moved_after:], logprobs[moved_after:]), moved_after


def test_sampled_requests_decode_compiled_too(engines):
    _, compiled = engines
    steps = compiled.runner.compiled.num_steps
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    assert [len(t) for t in compiled.generate(prompts(2), sampled)] == [8, 8]
    assert compiled.runner.compiled.num_steps - steps >= 7


@pytest.mark.long  # a cold compile: the step is compiled afresh, with no cache
def test_a_step_compiled_here_serves_inference_mode_requests_like_a_loaded_one(tiny_engine_model, tmp_path,
                                                                               monkeypatch):
    """A step compiled in this process (no artifacts anywhere) takes the inference-mode tensors of a
    warm-up request: its guards would refuse them (they were traced from ordinary tensors), so they
    are off as for a loaded step."""
    from shared.engine import warmup

    monkeypatch.setenv("TANDEM_COMPILE_CACHE_DIR", str(tmp_path))
    engine = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=4, compile=True))
    assert engine.runner.compiled.source == "compiled"
    warmup(engine)  # under torch.inference_mode
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with torch.inference_mode():
        tokens = engine.generate(prompts(2), greedy)
    eager = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=4))
    assert tokens == eager.generate(prompts(2), greedy)
    assert engine.runner.compiled.num_steps >= 5


def test_a_moved_request_keeps_the_decode_path_it_had_on_the_worker_it_left(tmp_path):
    """A request moves from a worker still decoding eagerly (its compile not handed over yet) to
    one that runs compiled. The first worker's outputs say its path (``EngineOutput.decode_path``,
    the chunks' ``decode_path``) and the gateway sends it with the moved request: the new worker
    recomputes and continues it eagerly, bit for bit as if it had not moved (int8 layers). Moved the
    other way, to a worker without the compiled step, it runs eagerly and its outputs say so."""
    from shared.model.loader import load_model
    from tiny_hf_models import save_tiny

    save_tiny("llama", tmp_path)
    model = load_model(tmp_path, "hf", torch.device("cpu"), torch.float32)
    model.quantize("int8", list(range(3, 60)))
    eager = EngineConfig(kv_cache_memory=4 << 20, block_size=4, quantization="int8", compile="off",
                         max_num_batched_tokens=16)
    prompt, moved_after = prompts(3)[2], 6

    def run(engine, request_id: str, tokens: list[int], **moved) -> tuple[list[int], list[float], set]:
        params = SamplingParams(max_tokens=16 - len(tokens) + len(prompt), temperature=0.0, ignore_eos=True,
                                logprobs=0, **moved)
        engine.add_request(request_id, tokens, params)
        ids, logprobs, paths = [], [], set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                ids.extend(out.new_token_ids)
                logprobs.extend(lp.logprob for lp in out.logprobs or ())
                paths.add(out.decode_path)
        return ids, logprobs, paths - {None}

    ids, logprobs, paths = run(LLMEngine(model, eager), "first", prompt)
    assert paths == {"eager"}
    compiled = LLMEngine(model, dataclasses.replace(eager, compile="on"))
    moved = dict(num_output_in_prompt=moved_after)
    assert run(compiled, "moved", prompt + ids[:moved_after], decode_path="eager", **moved) \
        == (ids[moved_after:], logprobs[moved_after:], {"eager"})
    assert compiled.runner.compiled.num_steps == 0
    # not told its path, the compiled worker runs it compiled
    assert run(compiled, "untold", prompt + ids[:moved_after], **moved)[2] == {"compiled"}
    assert compiled.runner.compiled.num_steps >= 16 - moved_after - 1
    back_ids, _, back_paths = run(LLMEngine(model, eager), "back", prompt + ids[:moved_after],
                                  decode_path="compiled", **moved)
    assert back_paths == {"eager"} and len(back_ids) == 16 - moved_after


@pytest.mark.long  # a cold compile: the step is compiled afresh, with no cache
def test_a_step_traced_over_a_pool_as_long_as_a_weight_serves_a_pool_of_another_size(tiny_engine_model, tmp_path,
                                                                                       monkeypatch):
    """The model's tensors have fixed sizes in the graph: were they symbolic, a weight's size that
    equals the traced pool's number of blocks would share its symbol, and the graph, loaded by a
    worker with another pool, would refuse that weight (a 1B model's o_proj panels against the
    compile process's pool once did)."""
    monkeypatch.setenv("TANDEM_COMPILE_CACHE_DIR", str(tmp_path))
    eager = LLMEngine(tiny_engine_model, EngineConfig(kv_cache_memory=4 << 20, block_size=4))
    config = EngineConfig(block_size=4, compile=True)
    size = tiny_engine_model.layers[0].qkv.shape[0]  # a weight's first size, as the pool's blocks
    traced = LLMEngine(tiny_engine_model,
                       dataclasses.replace(config, kv_cache_memory=size * eager.kv_spec.bytes_per_block))
    assert traced.num_blocks == size and traced.runner.compiled.source == "compiled"
    other = LLMEngine(tiny_engine_model, dataclasses.replace(config, kv_cache_memory=4 << 20))
    assert other.num_blocks != size and other.runner.compiled.source == "loaded"
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert other.generate(prompts(2), greedy) == eager.generate(prompts(2), greedy)
    assert other.runner.compiled.num_steps >= 5
