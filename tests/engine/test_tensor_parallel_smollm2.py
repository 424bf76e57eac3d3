"""The engine on parallel workers of real rank processes (shared-memory collectives, one thread each).

SmolLM2-135M-Instruct in float32 (9 heads, 3 KV heads, MLP 1536) at TP=3, one KV head per rank:
greedy text equal to transformers' with chunked prefill, speculation, a warm prefix cache,
structured output and preemption on the group; a random-weight Llama of 32 heads and 8 KV heads at
TP=2 and TP=4 equal to its own TP=1 text, and at TP=2 through the compiled decode step, compiled
before traffic or in the background and handed to every rank between two steps; SmolLM2 in
pipeline stages (PP=2, PP=3, TP=3 x PP=2) equal to transformers; the host and disk KV tiers keeping whole blocks gathered from every rank;
shapes that do not split refused before a rank starts; the quantized precisions on a group as close to float32
as one process is; a follower that dies breaks the group at its next step, and followers exit with
rank 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from loadtest.tools import synth_model
from shared.engine import EngineConfig, LLMEngine, SamplingParams
from shared.engine.parallel import free_port
from shared.grammar.spec import GrammarSpec
from shared.model.loader import load_model
from shared.model.parallel import ProcessGroupCollectives
from shared.model.shm_collectives import is_alive
from services.stack.waiting import wait_until
from shared.model.quant import EVAL_PASSAGE, calibration_token_ids, compare_models

from test_engine_smollm2 import GREEDY, hf_greedy_ignoring_eos, reference  # noqa: F401 — fixture
from test_kv_tiers_smollm2 import GREEDY as TIER_GREEDY, long_prompts, run as cached_run  # noqa: F401 — fixture


def group_engine(model: str, tp: int, pp: int = 1, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 32 << 20)
    return LLMEngine.from_config(EngineConfig(model=str(model), dtype="float32", tensor_parallel_size=tp,
                                              pipeline_parallel_size=pp, num_threads=1, **kw))


def test_smollm2_at_tp3_equals_transformers(smollm2_gguf, chat_prompts, reference):
    """Chunked prefill (16-token budget), speculation (4 drafts), then the same prompts again on
    the warm prefix cache, then a JSON-schema request: every rank's KV shard holds its one head.
    Can take over a minute on 2 cores with its module's first fixture: transformers' reference
    texts, then three rank processes loading the model."""
    engine = group_engine(smollm2_gguf, 3, max_num_batched_tokens=16, block_size=16, speculative_tokens=4)
    try:
        assert engine.model.group.size == 3 and engine.kv_cache.shape[-2] == 1  # one KV head per rank
        assert [p.poll() for p in engine.model.followers] == [None, None]
        assert engine.generate(chat_prompts, GREEDY) == reference
        stats = engine.stats()
        assert stats.num_steps > sum(len(p) for p in chat_prompts) // 16  # chunked
        assert engine.generate(chat_prompts, GREEDY) == reference
        cached = engine.stats().num_cached_prompt_tokens - stats.num_cached_prompt_tokens
        assert cached >= sum((len(p) - 1) // 16 * 16 for p in chat_prompts)
        schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        params = SamplingParams(max_tokens=40, temperature=0.0, grammar=GrammarSpec("json_schema", json.dumps(schema)))
        [out] = engine.generate([chat_prompts[0]], params)
        assert "city" in json.loads(engine.tokenizer.decode(out))
        assert engine.kv.pool.num_free_blocks == engine.num_blocks
    finally:
        engine.close()
    assert [p.returncode for p in engine.model.followers] == [0, 0]


def test_a_prefill_at_tp3_stops_between_layers_for_an_urgent_request_and_goes_on(smollm2_gguf, chat_prompts,
                                                                                 reference):
    """prefill_yield on a group: every rank stops after the layer rank 0 stops after, the urgent
    prompt runs whole meanwhile, and the stopped forward goes on on every rank: transformers' text.
    Over a minute on 2 cores: three rank processes load the model (and, first in its module,
    transformers' reference texts)."""
    engine = group_engine(smollm2_gguf, 3, block_size=16)
    try:
        engine.add_request("batch", chat_prompts[0], GREEDY, priority=2)
        engine.announce_request(0)  # a priority-0 request is on its way in
        assert engine.step() == []
        part = engine.runner.suspended
        assert part is not None and part.state.next_layer == 1
        engine.clear_announced()
        engine.add_request("urgent", chat_prompts[1], GREEDY, priority=0)
        outputs = engine.step()
        assert [o.request_id for o in outputs] == ["urgent"] and engine.runner.suspended is part
        engine.announce_request(0)  # it goes on a layer at a time while another one is announced
        assert engine.step() == [] and part.state.next_layer == 2
        engine.clear_announced()
        tokens = {"urgent": list(outputs[0].new_token_ids)}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert tokens == {"batch": reference[0], "urgent": reference[1]}
        assert engine.runner.suspended is None and engine.kv.pool.num_free_blocks == engine.num_blocks
    finally:
        engine.close()
    assert [p.returncode for p in engine.model.followers] == [0, 0]


def test_smollm2_at_tp3_decodes_through_the_compiled_step_with_transformers_text(smollm2_gguf, chat_prompts,
                                                                                 reference):
    """compile on at TP=3: every rank runs the compiled decode step (rank 0 compiles it, the others
    load it), its all-reduces in the graph; greedy text equal to transformers'. Minutes on 2 cores the
    first time (the step compiles; the compile cache keeps it for later runs)."""
    engine = group_engine(smollm2_gguf, 3, block_size=16, compile="on")
    try:
        assert engine.generate(chat_prompts, GREEDY) == reference
        assert engine.runner.compiled.num_steps > 0
    finally:
        engine.close()
    assert [p.returncode for p in engine.model.followers] == [0, 0]


@pytest.mark.parametrize("tp,pp", [(1, 2), (1, 3), (3, 2)])
def test_smollm2_in_pipeline_stages_equals_transformers(smollm2_gguf, chat_prompts, reference, tp, pp):
    """Stages of 15 or 10 layers, each with its layers' KV; TP=3 x PP=2 is six processes."""
    engine = group_engine(smollm2_gguf, tp, pp, max_num_batched_tokens=32)
    try:
        assert len(engine.model.layers) == 30 // pp and len(engine.model.followers) == tp * pp - 1
        assert engine.kv_cache.shape[1] == 30 // pp
        assert engine.generate(chat_prompts, GREEDY) == reference
    finally:
        engine.close()
    assert all(p.returncode == 0 for p in engine.model.followers)


def test_long_prompts_prefill_in_chunks_overlapped_across_stages_equal_transformers(smollm2_gguf, long_prompts,
                                                                                   hf_smol, smol_tokenizer):
    """A prompt of some 300 tokens, prefilled in one step at PP=2, runs in chunks that overlap
    across the two stages (stage 1 on a chunk while stage 0 runs the next): the same greedy text as
    transformers'."""
    engine = group_engine(smollm2_gguf, 1, 2, max_num_batched_tokens=1024)
    try:
        for prompt in long_prompts:
            with torch.no_grad():
                want = hf_smol.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                        eos_token_id=list(smol_tokenizer.stop_token_ids))[0, len(prompt):].tolist()
            before = engine.model.model.num_pipelined_steps
            assert engine.generate([prompt], GREEDY) == [want]
            assert engine.model.model.num_pipelined_steps == before + 1  # its one prefill step, chunked
    finally:
        engine.close()


def test_a_shape_that_does_not_split_is_refused_before_any_rank_starts(smollm2_gguf):
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        group_engine(smollm2_gguf, 2)
    with pytest.raises(ValueError, match="pipeline parallel size 31 is larger than the model's 30 layers"):
        group_engine(smollm2_gguf, 1, 31)
    with pytest.raises(ValueError, match="does not divide the model's MLP width 1536"):  # 9 heads, 3 KV heads: fine
        group_engine(smollm2_gguf, 9)


def test_smollm2_at_tp3_through_preemption(smollm2_gguf, chat_prompts, hf_smol):
    prompts = [chat_prompts[i] for i in (0, 2, 4)]
    n = 48
    reference = [hf_greedy_ignoring_eos(hf_smol, p, n) for p in prompts]
    per_block = 30 * 2 * 1 * 64 * 4 * 16  # a rank's shard of a block: one KV head
    engine = group_engine(smollm2_gguf, 3, kv_cache_memory=per_block * 11)
    try:
        got = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        assert engine.stats().num_preemptions > 0
        assert got == reference
    finally:
        engine.close()


@pytest.mark.parametrize("tp,pp", [(3, 1), (1, 2)])
def test_kv_tiers_keep_whole_blocks_of_a_parallel_worker(smollm2_gguf, make_engine, long_prompts, tmp_path, tp, pp):
    """40 blocks a rank: two long prompts do not fit together, so running b evicts a's prefix to the
    host tier, whose whole blocks are gathered from every rank; a comes back from there, and after a
    restart on the same disk directory from disk, each rank given its layers and heads back. The
    text equals one process's cold run. Over a minute on 2 cores: two starts of the group and one
    process's cold runs."""
    a, b = long_prompts
    cold = [make_engine(kv_cache_memory=40 * 737280).generate([p], TIER_GREEDY)[0] for p in (a, b)]
    per_block = 737280 // tp // pp  # a rank's share of a float32 block of 16 tokens
    tiers = dict(kv_cache_memory=40 * per_block, kv_host_memory=64 << 20, kv_disk_dir=str(tmp_path),
                 kv_disk_min_uses=1)
    engine = group_engine(smollm2_gguf, tp, pp, **tiers)
    try:
        assert engine.tiers.spec.num_kv_heads == 3 and engine.tiers.spec.num_layers == 30  # whole blocks
        assert cached_run(engine, a)[0] == cold[0]
        assert cached_run(engine, b)[0] == cold[1]
        assert engine.tiers.counters.offloaded_host > 0
        out, cached = cached_run(engine, a)
        assert out == cold[0] and cached >= (len(a) - 1) // 16 * 16 - 16
        assert engine.tiers.counters.onboarded > 0
    finally:
        engine.close()  # the pool's cached blocks go to disk
    engine = group_engine(smollm2_gguf, tp, pp, **tiers)
    try:
        out, cached = cached_run(engine, b)
        assert out == cold[1] and cached >= (len(b) - 1) // 16 * 16 - 16
        assert engine.tiers.counters.onboarded_disk > 0
    finally:
        engine.close()


@pytest.fixture(scope="module")
def heads_32(smollm2_gguf, tmp_path_factory):
    path = tmp_path_factory.mktemp("heads32")
    synth_model.write_model(path, "heads-32", "hf", tokenizer_from=str(smollm2_gguf))
    return path


def test_32_heads_at_tp2_and_tp4_equal_tp1(heads_32):
    prompts = [list(range(5 + i, 60 + 37 * i)) for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    texts = {}
    for tp in (1, 2, 4):
        engine = group_engine(heads_32, tp, max_num_batched_tokens=64)
        try:
            texts[tp] = engine.generate(prompts, params)
        finally:
            engine.close()
    assert texts[2] == texts[1]
    assert texts[4] == texts[1]


def test_the_compiled_decode_step_runs_on_every_rank_of_a_group(heads_32, tmp_path, monkeypatch):
    """compile on at TP=2: rank 0 compiles the step (its all-reduces and vocabulary-parallel embedding
    in the graph) and keeps it, the follower loads that one, and both run it every decode step:
    the eager group's greedy tokens, batch after batch, one prompt alone too."""
    monkeypatch.setenv("TANDEM_COMPILE_CACHE_DIR", str(tmp_path / "compile"))
    prompts = [list(range(5 + i, 60 + 37 * i)) for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    texts = {}
    for mode in ("off", "on"):
        engine = group_engine(heads_32, 2, max_num_batched_tokens=64, compile=mode)
        try:
            texts[mode] = engine.generate(prompts, params) + engine.generate(prompts[:1], params)
            if mode == "on":
                assert engine.runner.compiled.num_steps >= 2 * params.max_tokens - 2
                assert engine.runner.compiled.source == "compiled"
                assert engine.runner.compiled.num_followers_loaded == 1  # the follower loaded rank 0's
        finally:
            engine.close()
    assert texts["on"] == texts["off"]
    assert [p.returncode for p in engine.model.followers] == [0]


@pytest.mark.long
def test_a_group_compiles_in_the_background_and_hands_the_step_to_every_rank(heads_32, tmp_path, monkeypatch):
    """compile background at TP=2 (a worker's default): eager steps serve while rank 0 compiles the
    step on its compile thread (a group's, where one process would use a child process); the first
    step after it is ready has the follower load it from rank 0's artifacts and both run it once,
    and decode steps run it on both ranks from then on. The eager group's greedy tokens before,
    during and after the hand-over, for requests decoding across it too. Over a minute on 2 cores:
    a cold compile."""
    monkeypatch.setenv("TANDEM_COMPILE_CACHE_DIR", str(tmp_path / "compile"))
    monkeypatch.delenv("TANDEM_COMPILE_PROCESS", raising=False)  # the default: a child, for one process
    prompts = [list(range(5 + i, 60 + 37 * i)) for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = group_engine(heads_32, 2, max_num_batched_tokens=64)
    try:
        want = eager.generate(prompts, params)
    finally:
        eager.close()
    engine = group_engine(heads_32, 2, max_num_batched_tokens=64, compile="background")
    try:
        assert engine.decode_step() in ("compiling", "compiled")  # compiling, but for a very fast machine
        assert engine.generate(prompts, params) == want
        tokens = {}

        def run(num_steps: int | None = None) -> None:
            while engine.has_unfinished_requests() and num_steps != 0:
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                num_steps = None if num_steps is None else num_steps - 1

        for i in (0, 1):
            engine.add_request(f"across-{i}", prompts[i], params)
        run(3)  # their prefill and two decode steps: still decoding when the step is handed over
        assert engine.background_compile.wait(timeout=900) and engine.background_compile.error is None
        assert engine.decode_step() == "compiled"  # rank 0 has it; the group's next step, if not yet, hands it over
        for i in (2, 3):
            engine.add_request(f"after-{i}", prompts[i], params)
        run()
        assert tokens == {"across-0": want[0], "across-1": want[1], "after-2": want[2], "after-3": want[3]}
        assert engine.decode_step() == "compiled"
        compiled = engine.runner.compiled
        assert compiled.num_followers_loaded == 1  # the follower loaded rank 0's step, compiling none
        assert compiled.source == "compiled"  # by rank 0's thread: loaded, had a child compiled it
        steps = compiled.num_steps
        assert steps >= params.max_tokens - 1  # the later requests' decode rows, at least
        assert engine.generate(prompts, params) == want
        assert compiled.num_steps - steps >= params.max_tokens - 1
        engine.kv.check_integrity()
    finally:
        engine.close()
    assert [p.returncode for p in engine.model.followers] == [0]


def test_a_group_whose_background_compile_fails_decodes_eagerly_on_every_rank(heads_32, monkeypatch, caplog):
    """Rank 0's compile fails: it is logged, nothing reaches the follower, and both ranks go on with
    eager steps and the eager group's tokens."""
    def fail(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr("shared.engine.compiled.background.CompiledDecode.warm", fail)  # rank 0's process only
    prompts = [list(range(5 + i, 60 + 37 * i)) for i in range(2)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    texts = {}
    for mode in ("off", "background"):
        engine = group_engine(heads_32, 2, compile=mode)
        try:
            if mode == "background":
                assert engine.background_compile.wait(timeout=60)
                assert isinstance(engine.background_compile.error, RuntimeError)
            texts[mode] = engine.generate(prompts, params)
            assert engine.decode_step() == "eager" and engine.runner.compiled is None
        finally:
            engine.close()
        assert [p.returncode for p in engine.model.followers] == [0]
    assert texts["background"] == texts["off"]
    assert "compiling the decode step failed, decode steps stay eager: RuntimeError" in caplog.text


def test_quantized_precisions_split_as_closely_as_one_process(smollm2_gguf, smol_tokenizer):
    """int8 and gguf at TP=3 (ranks as threads here): the same top-1 agreement with float32 as one
    process, within four positions of 128. The shards are not the same numbers as one process's
    quantization (int8 scales are taken per shard; partial sums add in another order), so the
    tokens can differ where one process's are within rounding of a tie. How many such ties flip
    moves with any change of the last bits: positions agreeing alone / at TP=3 were int8 115 / 115,
    gguf 123 / 122 with torch's norm and SiLU, and int8 114 / 116, gguf 124 / 121 with the fused
    CPU ops (kernels/fused_cpu.py); a broken shard loses far more than four."""
    ids = smol_tokenizer.encode(EVAL_PASSAGE)[:128]
    calibration = calibration_token_ids(smol_tokenizer)
    cpu = torch.device("cpu")
    reference = load_model(smollm2_gguf, "gguf", cpu, torch.float32)
    for method in ("int8", "gguf"):
        one = load_model(smollm2_gguf, "gguf", cpu, torch.float32)
        one.quantize(method, calibration)
        alone = compare_models(reference, one, ids)["top1_agreement"]
        port, agreement = free_port(), {}

        def rank(r: int) -> None:
            group = ProcessGroupCollectives(r, 3, "127.0.0.1", port, cpu, timeout_s=120)
            model = load_model(smollm2_gguf, "gguf", cpu, torch.float32, group, method)
            model.quantize(method, calibration)
            assert model.quantization == method
            agreement[r] = compare_models(reference, model, ids)["top1_agreement"]  # collective on every rank

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(agreement) == 3, f"{method}: a rank failed"
        assert agreement[0] >= alone - 4 / 128, (method, agreement[0], alone)


def test_a_dead_follower_breaks_the_group_at_its_next_step(heads_32):
    engine = group_engine(heads_32, 2)
    try:
        [follower] = engine.model.followers
        assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        follower.kill()
        follower.wait(10)
        with pytest.raises(RuntimeError):
            engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0.0))
    finally:
        engine.close()


async def test_followers_exit_when_rank_0_is_killed(heads_32):
    script = textwrap.dedent(f"""
        from shared.engine import EngineConfig, LLMEngine
        engine = LLMEngine.from_config(EngineConfig(model={str(heads_32)!r}, dtype="float32",
                                                    tensor_parallel_size=4, num_threads=1, kv_cache_memory=8 << 20))
        print(*[p.pid for p in engine.model.followers], flush=True)
        input()
    """)
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(p) for p in rank0.stdout.readline().split()]
        assert len(pids) == 3
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.wait(10)
        await wait_until(lambda: not any(is_alive(p) for p in pids), timeout_s=20, what="every follower gone with rank 0")
    finally:
        rank0.kill()
        for pid in pids:  # a follower that outlived rank 0 (the test failed) is not left behind
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
