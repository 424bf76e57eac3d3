"""Which steps a pipeline runs in chunks overlapped across its stages, and the metadata of a chunk
run as a step of its own after the earlier ones."""

from __future__ import annotations

import torch

from shared.model.attention import AttentionMetadata, chunk_metadata
from shared.model.parallel import PIPELINE_MIN_CHUNK, pipeline_chunks


def test_one_long_prefill_on_a_pipeline_is_chunked_and_nothing_else_is():
    chunks = pipeline_chunks(1000, num_decodes=0, num_seqs=1, num_stages=2)
    assert len(chunks) == 4 and chunks[0][0] == 0 and chunks[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # contiguous, in order
    assert all(hi - lo >= PIPELINE_MIN_CHUNK for lo, hi in chunks)
    assert len(pipeline_chunks(200, 0, 1, 4)) == 200 // PIPELINE_MIN_CHUNK  # short: fewer, not smaller
    for whole in (pipeline_chunks(1000, 0, 1, 1),   # no pipeline
                  pipeline_chunks(1000, 3, 4, 2),   # decode rows beside it
                  pipeline_chunks(1000, 0, 2, 2),   # two prompts
                  pipeline_chunks(2 * PIPELINE_MIN_CHUNK - 1, 0, 1, 2)):  # too short to split
        assert len(whole) == 1


def test_a_chunk_is_a_step_of_its_tokens_after_the_earlier_ones():
    meta = AttentionMetadata(num_decodes=0, slot_mapping=torch.arange(100, 400), block_tables=torch.zeros(1, 30,
                             dtype=torch.int32), seq_lens=torch.tensor([400], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 300], dtype=torch.int32), max_seq_len=400,
                             max_query_len=300)  # 100 tokens cached before this step's 300
    part = chunk_metadata(meta, 150, 225, 300)
    assert part.slot_mapping.tolist() == list(range(250, 325))
    assert part.seq_lens.tolist() == [325] and part.max_seq_len == 325
    assert part.query_start_loc.tolist() == [0, 75] and part.max_query_len == 75
    assert part.block_tables is meta.block_tables and part.num_decodes == 0
