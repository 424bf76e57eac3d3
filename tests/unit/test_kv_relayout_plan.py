"""The plan of a KV transfer between parallel shapes (shared/transfer/relayout.py): every layer and
KV head of every target rank written exactly once, by a source rank that holds it (or whose stage
gathered it), and the ranks' layers and heads where the model puts them."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from shared.kvcache.layout import KvCacheSpec
from shared.model.parallel import TensorSplit, stage_layers
from shared.transfer.base import AgentMetadata, KvLayoutMismatch
from shared.transfer.relayout import GroupMetadata, KvShape, load_target, plan_pieces, stages_gathering

SHAPES = [(tp, pp) for tp in (1, 2, 3, 4, 6, 8, 16) for pp in (1, 2, 3)]
MODELS = [(30, 3), (2, 8), (7, 4)]  # (layers, KV heads): SmolLM2's, the 32-head test model's, an odd one


def shapes_of(num_layers: int, num_kv_heads: int):
    for tp, pp in SHAPES:
        fits = num_kv_heads % tp == 0 if tp <= num_kv_heads else tp % num_kv_heads == 0
        if fits and pp <= num_layers:
            yield KvShape(tp, pp, num_layers, num_kv_heads)


@pytest.mark.parametrize("num_layers,num_kv_heads", MODELS)
def test_ranks_hold_what_the_model_gives_them(num_layers, num_kv_heads):
    for shape in shapes_of(num_layers, num_kv_heads):
        cfg = SimpleNamespace(num_kv_heads=num_kv_heads)
        for rank in range(shape.size):
            split = TensorSplit(cfg, rank % shape.tp, shape.tp)
            assert shape.heads(rank) == range(split.kv_head_start, split.kv_head_start + split.num_kv_heads)
            assert shape.layers(rank) == stage_layers(num_layers, shape.pp, rank // shape.tp)


@pytest.mark.parametrize("num_layers,num_kv_heads", MODELS)
def test_every_target_layer_and_head_is_written_once_by_a_rank_that_has_it(num_layers, num_kv_heads):
    shapes = list(shapes_of(num_layers, num_kv_heads))
    for src, dst in itertools.product(shapes, shapes):
        pieces = plan_pieces(src, dst)
        written = {}
        for p in pieces:
            assert p.heads == dst.heads(p.dst)  # a piece carries all of its target rank's heads
            assert set(p.layers) <= set(src.layers(p.src)) & set(dst.layers(p.dst))
            if not p.gathered:  # its own heads: it must hold them
                assert set(p.heads) <= set(src.heads(p.src))
            for layer in p.layers:
                for head in p.heads:
                    assert (p.dst, layer, head) not in written, (src, dst, p)
                    written[p.dst, layer, head] = p.src
        expected = {(r, layer, head) for r in range(dst.size) for layer in dst.layers(r) for head in dst.heads(r)}
        assert set(written) == expected, (src, dst)
        gathering = stages_gathering(pieces, src)
        # a stage gathers exactly when none of its ranks holds some target rank's heads
        needs = {s for s in range(src.pp) for r in range(dst.size)
                 if set(src.layers(s * src.tp)) & set(dst.layers(r))
                 and not any(set(dst.heads(r)) <= set(src.heads(q)) for q in src.stage_ranks(s))}
        assert gathering == needs


def test_same_shape_is_rank_to_rank_whole_blocks():
    shape = KvShape(3, 2, 30, 3)
    pieces = plan_pieces(shape, shape)
    assert [(p.src, p.dst) for p in pieces] == [(r, r) for r in range(6)]
    assert all(p.layers == shape.layers(p.src) and not p.gathered for p in pieces)


def test_tp_down_gathers_and_shares_layers():
    pieces = plan_pieces(KvShape(3, 1, 30, 3), KvShape(1, 1, 30, 3))
    assert [(p.src, p.layers) for p in pieces] == [(0, range(0, 10)), (1, range(10, 20)), (2, range(20, 30))]
    assert all(p.gathered and p.heads == range(0, 3) for p in pieces)


def test_a_different_model_is_refused():
    with pytest.raises(KvLayoutMismatch, match="30 layers and 3 KV heads"):
        plan_pieces(KvShape(1, 1, 30, 3), KvShape(1, 1, 24, 3))


def test_metadata_of_a_single_process_reads_as_a_group_of_one():
    spec = KvCacheSpec(30, 3, 64, 16, torch.float32)
    single = AgentMetadata("w1", b"blob", 4096, 100, spec, "DRAM", 0)
    group = load_target(single.to_bytes())
    assert group.shape == KvShape(1, 1, 30, 3) and group.ranks == (single,) and group.name == "w1"
    ranks = tuple(AgentMetadata(f"w2-rank{r}" if r else "w2", b"x", 8192 * (r + 1), 100,
                                KvCacheSpec(30, 1, 64, 16, torch.float32), "DRAM", 0) for r in range(3))
    three = GroupMetadata(KvShape(3, 1, 30, 3), ranks)
    assert load_target(three.to_bytes()) == three and three.name == "w2"
