"""GraphedDecode (shared/engine/compiled/cuda_graph.py): decode steps replayed from CUDA graphs over static,
padded buffers, against the eager forward of the same step. On a GPU (TRITON_INTERPRET=0) the
graphs are real; under the interpreter a replay runs the captured function again over the same
static buffers, which checks the padding, the buffers and the KV writes of the padding rows."""

import pytest
import torch

from kernel_cases import REL_TOL, max_rel_err, tiny_model
from shared.kvcache.layout import KvCacheSpec
from shared.model.attention import AttentionMetadata, get_attention_backend
from shared.engine.compiled.cuda_graph import GraphedDecode, batch_buckets

BLOCK = 8
PROMPTS = [13, 21, 5, 30]  # tokens already in the cache of each sequence
NUM_BLOCKS = 24
KV_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _tables(device) -> torch.Tensor:
    """Sequence i owns consecutive blocks (sequence 0 starts at block 0: a padding row writing to
    slot -1 of block 0 would land in its cache), two blocks of room each; the rest stay zero."""
    rows, next_block = [], 0
    for n in PROMPTS:
        count = -(-(n + 2) // BLOCK)
        rows.append(list(range(next_block, next_block + count)))
        next_block += count
    width = max(map(len, rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)


def _meta(tables, seqs, q_lens, seq_lens, num_decodes, device):
    slots, positions = [], []
    for i, q_len, seq_len in zip(seqs, q_lens, seq_lens):
        for p in range(seq_len - q_len, seq_len):
            slots.append(int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK)
            positions.append(p)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    width = -(-max(seq_lens) // BLOCK)  # as the runner makes it: the blocks of the longest sequence
    meta = AttentionMetadata(
        num_decodes=num_decodes, slot_mapping=torch.tensor(slots, device=device), block_tables=tables[seqs, :width],
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_seq_len=max(seq_lens), max_query_len=max(q_lens))
    ids = torch.tensor([(7 * p + 3 * i) % 97 for i, p in zip(seqs, positions)] if num_decodes else
                       [(5 * p + i) % 97 for i, p in enumerate(positions)], device=device)
    return ids, torch.tensor(positions, device=device), meta


def _prefilled(dtype, device, max_num_seqs=8):
    """The tiny model, the Triton backend, a pool holding every prompt's KV, and graphs captured."""
    model = tiny_model(dtype, device)
    backend = get_attention_backend("triton", torch.device(device))
    pool = KvCacheSpec(2, 2, 16, BLOCK, dtype).allocate(NUM_BLOCKS, device)
    tables = _tables(device)
    seqs = list(range(len(PROMPTS)))
    ids, pos, meta = _meta(tables, seqs, PROMPTS, PROMPTS, 0, device)
    model.forward(ids, pos, pool, meta, backend)
    graphs = GraphedDecode(model, backend, BLOCK, max_num_seqs=max_num_seqs, max_model_len=128)
    graphs.warm(pool)
    return model, backend, pool, tables, graphs


def _decode(tables, seqs, device):
    lens = [PROMPTS[i] + 1 for i in seqs]
    return _meta(tables, seqs, [1] * len(seqs), lens, len(seqs), device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_step_matches_the_eager_step(device, dtype):
    model, backend, pool, tables, graphs = _prefilled(dtype, device)
    ids, pos, meta = _decode(tables, [2, 0, 3], device)  # 3 rows: bucket 4, one padding row
    eager_pool = pool.clone()
    expected = model.forward(ids, pos, eager_pool, meta, backend)
    got = graphs.forward(ids, pos, pool, meta)
    assert graphs.bucket(3) == 4 and graphs.num_steps == 1
    assert got.shape == expected.shape and torch.isfinite(got).all()
    # attention planned for the longest admitted context splits the sums otherwise on a GPU
    assert max_rel_err(got, expected) < 4 * REL_TOL[dtype]
    # the step's K/V landed where the eager step put them, and the padding row wrote nothing
    torch.testing.assert_close(pool, eager_pool, **KV_TOL[dtype])
    used = int(tables.max()) + 1
    assert not pool[used:].any()


def test_a_row_gets_the_same_bits_beside_any_batch_mates_in_its_bucket(device):
    model, backend, pool, tables, graphs = _prefilled(torch.bfloat16, device)
    outputs = []
    for seqs in ([0, 1, 2], [0, 3, 1, 2], [0, 2]):  # buckets 4, 4, 2
        ids, pos, meta = _decode(tables, seqs, device)
        outputs.append(graphs.forward(ids, pos, pool.clone(), meta)[0])
    assert torch.equal(outputs[0], outputs[1])
    # another bucket: the same row, within tolerance (bit-identical where the split plan agrees)
    assert max_rel_err(outputs[2][None], outputs[0][None]) < 4 * REL_TOL[torch.bfloat16]


def test_a_batch_past_the_largest_bucket_runs_eagerly(device):
    model, backend, pool, tables, graphs = _prefilled(torch.float32, device, max_num_seqs=2)
    assert graphs.buckets == [1, 2]
    ids, pos, meta = _decode(tables, [0, 1, 3], device)
    eager_pool = pool.clone()
    expected = model.forward(ids, pos, eager_pool, meta, backend)
    assert torch.equal(graphs.forward(ids, pos, pool, meta), expected)
    assert graphs.num_steps == 0 and torch.equal(pool, eager_pool)


@pytest.mark.parametrize("max_num_seqs,buckets", [
    (1, [1]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 16]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
])
def test_batch_buckets(max_num_seqs, buckets):
    assert batch_buckets(max_num_seqs) == buckets


def test_a_speculative_entry_replays_as_decode_rows_that_see_the_step_before_them(device):
    """The runner's layout of a draft (ModelRunner.prepare): sequence 1's last token and two draft
    tokens, each a decode row whose context ends at it, beside sequence 0's plain row. Its rows must
    equal the same tokens decoded one step at a time: the graph writes the step's K/V before
    attention reads the cache."""
    model, backend, pool, tables, graphs = _prefilled(torch.float32, device)
    start = PROMPTS[1]
    seqs, seq_lens = [0, 1, 1, 1], [PROMPTS[0] + 1, start + 1, start + 2, start + 3]

    def step(rows):  # rows: indices into seqs/seq_lens, run as one decode step of a token each
        return _meta(tables, [seqs[r] for r in rows], [1] * len(rows), [seq_lens[r] for r in rows], len(rows),
                     device)

    one_by_one = pool.clone()
    expected = []
    for rows in ([0, 1], [2], [3]):
        ids, pos, meta = step(rows)
        expected.append(model.forward(ids, pos, one_by_one, meta, backend))
    ids, pos, meta = step([0, 1, 2, 3])
    got = graphs.forward(ids, pos, pool, meta)
    expected = torch.cat(expected)
    assert graphs.num_steps == 1  # replayed, in bucket 4
    assert max_rel_err(got, expected) < 4 * REL_TOL[torch.float32]
    torch.testing.assert_close(pool, one_by_one, **KV_TOL[torch.float32])
