"""Decode-only steps on a GPU replayed from CUDA graphs, one graph per batch size bucket.

An eager decode step launches every kernel from Python: a dozen per layer (norms, projections,
rotary, the KV write, attention), about 200 for a 16-layer model. On an H200 a Llama-3.2-1B-shaped
step then took 7-9 ms whatever the batch, against 0.5 ms to read its weights once: the GPU waited
on the launches. ``GraphedDecode`` captures the whole forward of a decode step once per bucket
(1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs``) and a step replays the smallest bucket
that holds its batch: one launch.

A graph replays fixed addresses and fixed launch grids, so a step's inputs are copied into static
buffers sized for the largest bucket, and everything that sets a grid is fixed per bucket:

* the rows past the batch are padding: sequence length 0 (the decode kernel writes zeros for
  them) and KV slot -1 (the KV write skips them);
* the block table has a column for every block of the longest context the engine admits, and
  attention is planned for that length (``max_seq_len``): its split-K plan depends only on the
  bucket, and blocks past a sequence's length are never read.

A decode row therefore gets the same bits in a given bucket whatever its batch-mates. Across
buckets the split count can differ (split-K sums in another order), so unlike the CPU's compiled
step a row is not bit-identical alone and in a batch of, say, 40. Prefill and chunked steps stay
eager; the runner sends a request's decode rows all one way (``ModelRunner.split``).

A speculative entry (the last token and its draft) replays here too, as decode rows, a row per token
whose context ends at it: the forward writes every row's K/V into the cache before attention reads
it, so a draft token's row sees the tokens of the step before it, as its own decode step would.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from shared.model.attention import AttentionBackend, AttentionMetadata

log = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to the first that holds ``max_num_seqs``."""
    sizes = [1, 2, 4, *range(8, max_num_seqs + 8, 8)]
    return [b for b in sizes if b < max_num_seqs] + [next(b for b in sizes if b >= max_num_seqs)]


class _Eager:
    """Stands in for ``torch.cuda.CUDAGraph`` where there is none (the CPU, in tests): "capturing"
    keeps the function, and a replay runs it again over the same static buffers, which is what a
    graph replay computes."""

    def __init__(self) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn

    def replay(self) -> torch.Tensor:
        return self.fn()


class _CudaGraph:
    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> None:
        # warm on a side stream first (Triton compiles, allocator settles), as capture wants
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.out = fn()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class GraphedDecode:
    def __init__(self, model, backend: AttentionBackend, block_size: int, max_num_seqs: int,
                 max_model_len: int) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.buckets = batch_buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        self.num_steps = 0  # decode steps replayed
        self.source: str | None = None  # "captured" after warm()
        self.warm_s = 0.0
        biggest, dev = self.buckets[-1], model.device
        self.ids = torch.zeros(biggest, dtype=torch.long, device=dev)
        self.positions = torch.zeros(biggest, dtype=torch.long, device=dev)
        self.slots = torch.full((biggest,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(biggest, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(biggest, self.max_blocks, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(biggest + 1, dtype=torch.int32, device=dev)
        self._graphs: dict[int, _Eager | _CudaGraph] = {}

    def _meta(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_decodes=bucket, slot_mapping=self.slots[:bucket], block_tables=self.tables[:bucket],
            seq_lens=self.seq_lens[:bucket], query_start_loc=self.query_start[:bucket + 1],
            max_seq_len=self.max_blocks * self.block_size, max_query_len=1)

    def _step(self, bucket: int, kv_cache: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The forward of a step of ``bucket`` rows over the static buffers."""
        ids, positions = self.ids[:bucket], self.positions[:bucket]
        # fresh metadata per call: a backend may keep per-step plans in it (a graph calls this once)
        return lambda: self.model.forward(ids, positions, kv_cache, self._meta(bucket), self.backend)

    def warm(self, kv_cache: torch.Tensor) -> None:
        """Capture every bucket's graph, the largest first (they share one memory pool). The static
        buffers hold padding while capturing: nothing is written to the cache."""
        started = time.perf_counter()
        cuda = self.model.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        for bucket in reversed(self.buckets):
            graph = _CudaGraph(pool) if cuda else _Eager()
            graph.capture(self._step(bucket, kv_cache))
            self._graphs[bucket] = graph
        if cuda:
            torch.cuda.synchronize()
        self.source = "captured"
        self.warm_s = time.perf_counter() - started
        log.info("decode step captured as %d CUDA graphs (batch buckets %s) in %.1f s", len(self.buckets),
                 ",".join(map(str, self.buckets)), self.warm_s)

    def bucket(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states [B, hidden] of a decode-only step; writes its K/V into ``kv_cache``."""
        num_seqs = input_ids.shape[0]
        bucket = self.bucket(num_seqs)
        if bucket is None:  # more rows than the engine schedules: not expected, but still correct
            return self.model.forward(input_ids, positions, kv_cache, meta, self.backend)
        width = meta.block_tables.shape[1]
        self.ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slots[:num_seqs].copy_(meta.slot_mapping)
        self.slots[num_seqs:bucket].fill_(-1)
        self.seq_lens[:num_seqs].copy_(meta.seq_lens)
        self.seq_lens[num_seqs:bucket].zero_()
        self.tables[:num_seqs, :width].copy_(meta.block_tables)  # columns past a length are never read
        with torch.inference_mode():
            hidden = self._graphs[bucket].replay()
        self.num_steps += 1
        return hidden[:num_seqs].clone()  # the graph's output is overwritten by the next replay
