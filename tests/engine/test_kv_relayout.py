"""KV written between workers of different parallel shapes over real NIXL, by real rank processes:
every rank of the writer writes its pieces of the plan into the target's ranks, and the target's
whole blocks (read back gathered from every rank) are bit-equal to what the writer held. A
random-weight Llama of 2 layers and 8 KV heads (32 query heads), so that TP 1/2/4 and PP 2
all split it; the same pairs on SmolLM2 with greedy text are in
tests/integration/test_parallel_disagg.py."""

from __future__ import annotations

import platform
import uuid

import pytest
import torch

from loadtest.bench.relayout import Endpoint
from loadtest.tools import synth_model
from shared.engine import EngineConfig, LLMEngine
from shared.transfer.relayout import KvShape, plan_pieces

if platform.system() != "Linux":
    pytest.skip("NIXL (nixl-cu12) is a dependency on Linux only", allow_module_level=True)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def heads_32(smollm2_gguf, tmp_path_factory):
    path = tmp_path_factory.mktemp("relayout")
    synth_model.write_model(path, "heads-32", "hf", tokenizer_from=str(smollm2_gguf))
    return path


def start(model, tp: int, pp: int) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(model), dtype="float32", tensor_parallel_size=tp,
                                              pipeline_parallel_size=pp, num_threads=1, kv_cache_memory=4 << 20,
                                              max_model_len=256))


# (writer TP, PP) -> (target TP, PP): TP down (the writer's stage gathers its heads), stages into one
# process, one process into stages of two ranks (per-head staging at a layer offset), the same shape
# (whole blocks, no staging), and stages of two ranks into four ranks (gathers and layer shares per
# stage). TP=1 into TP=3 and TP=3 into TP=1 and TP=3 run on SmolLM2 in a stack:
# tests/integration/test_parallel_disagg.py
PAIRS = [((4, 1), (1, 1)), ((1, 2), (1, 1)), ((1, 1), (2, 2)), ((2, 1), (2, 1)), ((2, 2), (4, 1))]


@pytest.mark.parametrize("src_shape,dst_shape", PAIRS, ids=[f"tp{a}pp{b}-to-tp{c}pp{d}" for (a, b), (c, d) in PAIRS])
def test_kv_written_between_shapes_arrives_whole(heads_32, src_shape, dst_shape):
    tag = uuid.uuid4().hex[:6]
    src = Endpoint(start(heads_32, *src_shape), f"src-{tag}")
    try:
        dst = Endpoint(start(heads_32, *dst_shape), f"dst-{tag}")
    except BaseException:
        src.close()
        raise
    try:
        cfg = src.engine.model.cfg
        shape = (5, cfg.num_layers, 2, src.engine.block_size, cfg.num_kv_heads, cfg.head_dim)
        data = torch.randn(shape, generator=torch.Generator().manual_seed(7))
        src_ids, dst_ids = [3, 4, 9, 10, 11], [20, 21, 22, 7, 30]  # runs of consecutive ids on both sides
        src.write_whole(src_ids, data)
        before = dst.read_whole(list(range(40)))

        handle = src.send(dst, src_ids, dst_ids, b"all landed")
        [note] = dst.notes
        assert note.message == b"all landed"

        after = dst.read_whole(list(range(40)))
        assert torch.equal(after[dst_ids], data)  # every layer and head of every block, bit for bit
        untouched = [b for b in range(40) if b not in dst_ids]
        assert torch.equal(after[untouched], before[untouched])
        # the bytes written: each target rank's own layers and heads of the 5 blocks, once
        src_kv = KvShape(*src_shape, cfg.num_layers, cfg.num_kv_heads)
        dst_kv = KvShape(*dst_shape, cfg.num_layers, cfg.num_kv_heads)
        per_head_layer = 2 * src.engine.block_size * cfg.head_dim * 4
        wanted = sum(len(dst_kv.layers(r)) * len(dst_kv.heads(r)) for r in range(dst_kv.size)) * per_head_layer * 5
        assert note.num_bytes == handle.num_bytes == wanted
        pieces = plan_pieces(src_kv, dst_kv)
        assert handle.num_descriptors <= sum(5 for _ in pieces)  # at most one per block per piece
    finally:
        dst.close()
        src.close()


def test_staging_is_reused_across_writes_of_other_sizes(heads_32):
    """A writer's registered staging slabs serve later writes of other sizes and shapes (a big
    slab taken for a small piece, a small one passed over for a big one), every write whole."""
    tag = uuid.uuid4().hex[:6]
    src = Endpoint(start(heads_32, 1, 2), f"src-{tag}")
    targets = []
    try:
        targets = [Endpoint(start(heads_32, tp, pp), f"dst{tp}{pp}-{tag}") for tp, pp in ((1, 1), (4, 1))]
        cfg = src.engine.model.cfg
        for i, (dst, n) in enumerate([(targets[0], 150), (targets[1], 3), (targets[1], 12), (targets[0], 2)]):
            data = torch.randn(n, cfg.num_layers, 2, src.engine.block_size, cfg.num_kv_heads, cfg.head_dim,
                               generator=torch.Generator().manual_seed(i))
            ids = list(range(1, n + 1))
            src.write_whole(ids, data)
            src.send(dst, ids, [b + 5 for b in ids], f"write {i}".encode())
            assert torch.equal(dst.read_whole([b + 5 for b in ids]), data), i
    finally:
        for endpoint in [*targets, src]:
            endpoint.close()
