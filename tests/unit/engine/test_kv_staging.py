"""A stage's KV heads put together for a target rank that holds more heads than one of ours: in the
stage's shared staging (ranks sharing memory) and over the stage's collectives (the path of CUDA
ranks and of ranks that share none), the same blocks either way, every head where the model puts
it, each replicated head once. Ranks are threads of this process in a real process group."""

from __future__ import annotations

import pytest
import torch

from shared.engine.kv_staging import stage_staging
from shared.engine.parallel import _stage_heads, free_port
from shared.model.parallel import ProcessGroupCollectives
from shared.transfer.relayout import KvShape, plan_pieces
from thread_ranks import run_ranks

LAYERS, BLOCKS, BS, D = 3, 12, 4, 8


def whole_blocks(num_heads: int) -> torch.Tensor:
    """The model's whole pool [blocks, layers, 2, bs, heads, D], each value telling where it lies."""
    return torch.arange(BLOCKS * LAYERS * 2 * BS * num_heads * D, dtype=torch.float32).view(
        BLOCKS, LAYERS, 2, BS, num_heads, D)


def run_stage(tp: int, num_heads: int, shared_memory: bool, block_ids: list[int]) -> list:
    """Each rank of a TP=``tp`` stage puts the heads together for a TP=1 target; their results."""
    src, dst = KvShape(tp, 1, LAYERS, num_heads), KvShape(1, 1, LAYERS, num_heads)
    pieces, whole = plan_pieces(src, dst), whole_blocks(num_heads)
    def stage(group) -> tuple | None:
        heads = src.heads(group.rank)
        shard = whole[:, :, :, :, heads.start:heads.stop].clone()  # this rank's pool: its heads
        gathered = _stage_heads(group, shard, block_ids, src, group.rank, pieces, transfer=None)
        return None if gathered is None else (gathered.blocks.clone(), gathered.first_layer, gathered.registered)

    results = run_ranks(tp, stage, shared_memory=shared_memory, timeout_s=30)
    return results, pieces, whole


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-staging", "collectives"])
@pytest.mark.parametrize("tp,num_heads", [(4, 8), (3, 3), (4, 2)], ids=["4-of-8", "3-of-3", "4-of-2-replicated"])
def test_a_stage_puts_every_head_of_the_blocks_together_for_its_writers(tp, num_heads, shared_memory):
    block_ids = [7, 2, 3, 11, 0]
    results, pieces, whole = run_stage(tp, num_heads, shared_memory, block_ids)
    writers = {p.src for p in pieces if p.gathered}
    assert writers and all((results[r] is None) == (r not in writers) for r in range(tp))
    for rank in writers:
        blocks, first_layer, registered = results[rank]
        layers = [p.layers for p in pieces if p.src == rank]
        assert first_layer <= min(r.start for r in layers)
        got = blocks[:, [l - first_layer for r in layers for l in r]]
        assert torch.equal(got, whole[block_ids][:, [l for r in layers for l in r]])
        assert not registered  # no agent to register with here


def test_the_shared_staging_is_kept_and_made_anew_larger():
    def staging_sizes(group) -> tuple:
        first = stage_staging(group, 1000)
        again = stage_staging(group, 5000)
        bigger = stage_staging(group, 40 << 20)
        return first is again, first.num_bytes, bigger.num_bytes, bigger is not first

    sizes = run_ranks(2, staging_sizes, timeout_s=30)
    assert sizes == [(True, 16 << 20, 48 << 20, True)] * 2
    gloo_only = ProcessGroupCollectives(0, 1, "127.0.0.1", free_port(), torch.device("cpu"), shared_memory=False)
    assert stage_staging(gloo_only, 1000) is None  # no shared memory: the collectives' gather instead
