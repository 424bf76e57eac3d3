"""Tensor parallelism at the model level: a random-weight Llama of 32 heads and 8 KV heads (head size
8, so it runs in seconds) split over 2, 4, 8 and 16 ranks gives the logits of the whole model, every
rank the same; shapes that do not split are refused with the numbers; gguf blocks split on block
boundaries quantize as the whole weight does; a compiled step reaches a follower only where every
follower could load it. The ranks here are threads of this process, each with
its own gloo process group (tests/engine/test_tensor_parallel_smollm2.py runs rank processes)."""

from __future__ import annotations

import pytest
import torch

from shared.kvcache.layout import KvCacheSpec
from shared.engine.compiled.step import CompiledDecode
from shared.model.config import ModelConfig
from shared.model.loader import load_model
from shared.engine.parallel import CompiledStepUnavailable, ParallelModel, follow, join_stage
from shared.model.parallel import (TensorSplit, check_pipeline_parallel, check_tensor_parallel, shard_layer,
                                   stage_layers)
from shared.model.quant import quantize_blocks
from thread_ranks import run_ranks
from tiny_hf_models import save_tiny

HEADS_32 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=250)  # 250: not a multiple of 4, 8 or 16 ranks, so the vocabulary is padded


@pytest.fixture(scope="module")
def heads_32(tmp_path_factory):
    path = tmp_path_factory.mktemp("heads32")
    save_tiny("llama", path, **HEADS_32)
    return path


@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_split_model_gives_the_whole_models_logits(heads_32, tp):
    ids = [(7 * i + 3) % 250 for i in range(40)]
    whole = load_model(heads_32, "hf", torch.device("cpu"), torch.float32).prefill_logits(ids)

    def shard_logits(group):
        model = load_model(heads_32, "hf", torch.device("cpu"), torch.float32, group)
        return model.num_kv_heads, model.embed.shape[0], model.prefill_logits(ids)

    results = run_ranks(tp, shard_logits)
    kv_heads, vocab_rows, _ = results[0]
    assert kv_heads == max(1, 8 // tp)  # 16 ranks: each of the 8 KV heads on two ranks
    assert vocab_rows == -(-250 // tp)
    for _, _, logits in results:
        assert torch.equal(logits, results[0][2])  # every rank the same bits
    got = results[0][2]
    assert got.shape == whole.shape
    torch.testing.assert_close(got, whole, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), whole.argmax(-1))


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2), (4, 2)])
def test_pipeline_stages_give_the_whole_models_logits(heads_32, tp, pp):
    """Two stages of one layer each (the model has two), each stage of ``tp`` ranks: stage 0's ranks
    get the whole model's logits, the other stage's none (it holds no LM head)."""
    ids = [(11 * i + 5) % 250 for i in range(33)]
    whole = load_model(heads_32, "hf", torch.device("cpu"), torch.float32).prefill_logits(ids)

    def stage_logits(world):
        group, pipeline = join_stage(world, tp, pp, 2)
        model = load_model(heads_32, "hf", torch.device("cpu"), torch.float32, group, pipeline=pipeline)
        assert len(model.layers) == 1 and (model.embed is None) == (pipeline.stage > 0)
        return model.prefill_logits(ids)

    results = run_ranks(tp * pp, stage_logits)
    assert all(r is None for r in results[tp:])
    for logits in results[:tp]:
        torch.testing.assert_close(logits, whole, rtol=1e-4, atol=1e-4)
        assert torch.equal(logits.argmax(-1), whole.argmax(-1))


def test_stages_share_the_layers_out_contiguously_and_one_per_stage_at_least():
    assert [stage_layers(30, 4, s) for s in range(4)] == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert [len(stage_layers(30, 3, s)) for s in range(3)] == [10, 10, 10]
    check_pipeline_parallel(_cfg(), 30)
    with pytest.raises(ValueError, match="pipeline parallel size 31 is larger than the model's 30 layers"):
        check_pipeline_parallel(_cfg(), 31)


def _cfg(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=1000, hidden_size=576, intermediate_size=1536, num_layers=30,
                num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                max_position_embeddings=2048, tie_word_embeddings=True)
    return ModelConfig(**(base | kw))


def test_shapes_that_do_not_split_are_refused_with_their_numbers():
    smol = _cfg()
    check_tensor_parallel(smol, 3, "gguf")  # 3 heads, 1 KV head, 512 MLP channels and whole blocks per rank
    check_tensor_parallel(_cfg(intermediate_size=1152), 9, "none")  # each KV head on 3 ranks
    with pytest.raises(ValueError, match="tensor parallel size 2 does not divide the model's 9 attention heads"):
        check_tensor_parallel(smol, 2)
    with pytest.raises(ValueError, match="must divide the model's 4 KV heads or be a multiple"):
        check_tensor_parallel(_cfg(num_heads=12, num_kv_heads=4), 6)
    with pytest.raises(ValueError, match="MLP width 1000"):
        check_tensor_parallel(_cfg(intermediate_size=1000), 3)
    # 6 heads of 16: o_proj has 96 inputs, 3 blocks of 32, which 6 ranks cannot share (16 inputs each)
    narrow = _cfg(num_heads=6, num_kv_heads=3, head_dim=16, intermediate_size=1152)
    with pytest.raises(ValueError, match="would cut the gguf blocks of o_proj: its 96 inputs make 3 blocks"):
        check_tensor_parallel(narrow, 6, "gguf")
    check_tensor_parallel(narrow, 6, "none")  # a float weight splits anywhere
    with pytest.raises(ValueError, match="gguf blocks of down: its 1600 inputs make 50 blocks"):
        check_tensor_parallel(_cfg(num_heads=12, num_kv_heads=4, head_dim=32, intermediate_size=1600), 4, "gguf")
    with pytest.raises(ValueError, match="at least 1"):
        check_tensor_parallel(smol, 0)


def test_the_loader_refuses_a_split_before_the_group_loads(heads_32):
    class FakeGroup:  # only its size is read before the refusal
        rank, size = 0, 3

    with pytest.raises(ValueError, match="does not divide the model's 32 attention heads"):
        load_model(heads_32, "hf", torch.device("cpu"), torch.float32, FakeGroup())


@pytest.mark.parametrize("four_bit", [True, False])
def test_gguf_blocks_of_a_shard_are_the_whole_weights_blocks(four_bit):
    """Column and row splits on block boundaries quantize to exactly the rows and blocks of the whole
    weight's quantization, so a rank multiplies the very blocks a single process would."""
    torch.manual_seed(0)
    cfg = _cfg(num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=128, intermediate_size=256)
    weights = {"attn_norm": torch.ones(128), "mlp_norm": torch.ones(128),
               "qkv": torch.randn(256, 128), "o_proj": torch.randn(128, 128),
               "gate_up": torch.randn(512, 128), "down": torch.randn(128, 256)}
    if four_bit:  # on a 4-bit grid per block, as a GGUF Q4 layer dequantized is
        weights = {k: (torch.randint(0, 16, v.shape) * 0.01 - 0.07 if v.dim() == 2 else v) for k, v in weights.items()}
    whole = {k: quantize_blocks(v) for k, v in weights.items() if v.dim() == 2}
    assert whole["down"].bits == (4 if four_bit else 8)
    tp = 2
    for rank in range(tp):
        split = TensorSplit(cfg, rank, tp)
        part = shard_layer(cfg, weights, rank, tp)
        down = quantize_blocks(part["down"])  # row-parallel: input columns of this rank's channels
        k0, width = rank * split.intermediate_size, split.intermediate_size
        per_byte = 256 // whole["down"].qs.shape[1]  # inputs per byte of qs: 2 at 4 bits, 1 at 8
        assert torch.equal(down.qs, whole["down"].qs[:, k0 // per_byte:(k0 + width) // per_byte])
        assert torch.equal(down.d, whole["down"].d[:, k0 // 32:(k0 + width) // 32])
        gate_up = quantize_blocks(part["gate_up"])  # column-parallel: whole rows
        rows = torch.cat([torch.arange(k0, k0 + 128), 256 + torch.arange(k0, k0 + 128)])
        assert torch.equal(gate_up.qs, whole["gate_up"].qs[rows])
        assert torch.equal(gate_up.d, whole["gate_up"].d[rows])


@pytest.mark.parametrize("loads", [True, False])
def test_a_compiled_step_runs_on_the_group_only_where_every_follower_loaded_it(heads_32, tmp_path, monkeypatch,
                                                                             loads):
    """``share_compiled`` (the step's compile and load stood in for): where the follower loads rank 0's
    step, both ranks run it once and rank 0 counts the follower's load; where it cannot, rank 0 hears
    so before either runs it, raises, and the group goes on (a later operation, then stop)."""
    runs = []

    def warm(self, kv_cache, artifacts=None, store=None, run_once=True):
        if not loads:
            raise OSError(f"no step {artifacts.key} in {artifacts.root}")
        self.source = "loaded"

    monkeypatch.setattr(CompiledDecode, "warm", warm)
    monkeypatch.setattr(CompiledDecode, "run_once", lambda self, kv_cache: runs.append(self.model.group.rank))

    def rank(world):
        model = load_model(heads_32, "hf", torch.device("cpu"), torch.float32, world)
        if world.rank > 0:
            return follow(model, world)
        group = ParallelModel(model, world)
        group.attach_kv(KvCacheSpec(len(model.layers), model.num_kv_heads, model.cfg.head_dim, 16,
                                    torch.float32).allocate(4, model.device), 16)
        compiled = CompiledDecode(model, 16, 1)
        artifacts = type("Artifacts", (), {"root": tmp_path, "key": "step"})()
        try:
            return group.share_compiled(compiled, artifacts, 1).num_followers_loaded
        except CompiledStepUnavailable as exc:
            return str(exc)
        finally:
            group.compute_logits(torch.zeros(1, model.cfg.hidden_size))  # the follower still follows
            group.close()

    result = run_ranks(2, rank)[0]
    if loads:
        assert result == 1 and sorted(runs) == [0, 1]
    else:
        assert result == "1 of the 1 followers could not load the compiled decode step step" and runs == []


def test_a_ranks_compile_key_is_the_same_after_its_group_has_run(heads_32):
    """The key of a rank's compiled step names the group's size only: not the collectives each layer
    holds, whose counters change as the group runs (else no restart and no compile process finds it)."""
    from shared.engine.compiled.artifacts import engine_artifact_key

    def keys(group):
        model = load_model(heads_32, "hf", torch.device("cpu"), torch.float32, group)
        before = engine_artifact_key(model, 16, 1)
        model.prefill_logits([5, 6, 7])
        assert group.num_calls > 0
        return before, engine_artifact_key(model, 16, 1)

    (before, after), (other_before, _) = run_ranks(2, keys)
    assert before == after == other_before
