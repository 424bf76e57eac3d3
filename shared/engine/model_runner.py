"""Turns a SchedulerOutput into tensors, runs the model, samples."""

from __future__ import annotations

import torch

from shared.engine.sampler import SampledToken, Sampler
from shared.engine.scheduler import SchedulerOutput
from shared.model.attention import AttentionBackend, AttentionMetadata
from shared.model.compiled import CompiledDecode
from shared.model.cuda_graph import GraphedDecode
from shared.model.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, backend: AttentionBackend,
                 block_size: int, sampler: Sampler, compiled: CompiledDecode | GraphedDecode | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = block_size
        self.sampler = sampler
        self.device = model.device
        self.compiled = compiled  # runs the decode rows when set: the CPU's compiled step, or CUDA graphs

    def use_compiled(self, compiled: CompiledDecode) -> None:
        """From the background compile: the engine thread's next decode-only step runs the graph."""
        self.compiled = compiled

    def prepare(self, out: SchedulerOutput, num_decode_entries: int,
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The step's tensors, ``out`` in ``split``'s order. Its first ``num_decode_entries`` entries
        are attention's decode rows, one row per token: a speculative entry's draft tokens each a row
        of its own whose context ends at that token (its K/V and the K/V of the step's tokens before
        it are written before attention reads them). So a verified draft token's attention is
        computed exactly as a decode row at its position would be, and a greedy request's tokens are
        the same with speculation on or off."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        step_starts: list[int] = []
        query_start = [0]
        logits_rows: list[int] = []
        max_blocks = max(len(s.block_ids) for s in out.scheduled)
        tables = []
        num_decodes = 0
        for i, s in enumerate(out.scheduled):
            tokens = s.request.all_token_ids + s.draft if s.draft else s.request.all_token_ids
            end = s.start + s.num_new_tokens
            input_ids.extend(tokens[s.start:end])
            positions.extend(range(s.start, end))
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in range(s.start, end))
            table = s.block_ids + [0] * (max_blocks - len(s.block_ids))
            if i < num_decode_entries:  # a row per token
                for p in range(s.start, end):
                    seq_lens.append(p + 1)
                    step_starts.append(s.start)
                    query_start.append(query_start[-1] + 1)
                    tables.append(table)
                num_decodes += s.num_new_tokens
            else:
                seq_lens.append(end)
                query_start.append(query_start[-1] + s.num_new_tokens)
                tables.append(table)
            if s.samples:  # the last token's row, and a speculative step's draft rows after it
                logits_rows.extend(range(query_start[-1] - 1 - len(s.draft), query_start[-1]))
        dev = self.device
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            max_seq_len=max(seq_lens),
            max_query_len=max(q - p for p, q in zip(query_start, query_start[1:])),
            # only where a row reads K/V of the step's own tokens before it: a verified draft
            step_starts=torch.tensor(step_starts, dtype=torch.long, device=dev)
            if any(a != b - 1 for a, b in zip(step_starts, seq_lens)) else None,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, meta, logits_rows

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                num_compiled: int = 0) -> torch.Tensor:
        """Hidden states of every token of the step: the first ``num_compiled`` entries (decode rows,
        one token each) through the compiled step, the others eagerly, two forwards if both."""
        if num_compiled == 0:
            return self.model.forward(ids, pos, self.kv_cache, meta, self.backend)
        if num_compiled == ids.shape[0]:
            return self.compiled.forward(ids, pos, self.kv_cache, meta)
        n = num_compiled
        starts = meta.step_starts
        first = AttentionMetadata(n, meta.slot_mapping[:n], meta.block_tables[:n], meta.seq_lens[:n],
                                  meta.query_start_loc[:n + 1], int(meta.seq_lens[:n].max()), 1,
                                  step_starts=None if starts is None else starts[:n])
        rest = AttentionMetadata(meta.num_decodes - n, meta.slot_mapping[n:], meta.block_tables[n:],
                                 meta.seq_lens[n:], meta.query_start_loc[n:] - n, int(meta.seq_lens[n:].max()),
                                 meta.max_query_len)
        return torch.cat([self.compiled.forward(ids[:n], pos[:n], self.kv_cache, first),
                          self.model.forward(ids[n:], pos[n:], self.kv_cache, rest, self.backend)])

    def split(self, out: SchedulerOutput) -> tuple[SchedulerOutput, int, int]:
        """The step's entries in the order they run: the decode rows that run compiled, the other
        decode rows, then prefill chunks; and how many entries the first two groups hold.

        A request's decode rows all run one way, fixed at its first one: compiled if the compiled
        step is there by then, else eager to its end (a request decoding when the background
        compile hands over does not change path). A request moved from another worker comes with
        the path it had there (``SamplingParams.decode_path``) and keeps it where this worker can.
        A speculative entry (the last token and its draft) is decode rows too, a row per token, on
        its request's path (the CPU's compiled step and the GPU's CUDA graphs both verify drafts).
        Decode rows run compiled also in a step that prefills another request, beside the eager
        prefill: the compiled step's sums differ from eager's in the last bits, which int8 rounding
        can carry into a token, so a request's tokens would otherwise depend on whether someone was
        prefilling beside it."""
        path = "eager" if self.compiled is None else "compiled"  # for a request's first decode row
        compiled, eager, prefill = [], [], []
        num_compiled_rows = 0
        for s in out.scheduled:
            if (s.num_new_tokens == 1 or s.draft) and s.request.decodes_at(s.start):  # decode rows
                # None: its first decode row. "compiled" here without the compiled step: it ran
                # compiled on a worker it moved from, and runs eagerly here (its tokens can then
                # differ in the last bits from what they would have been without the move)
                if s.request.decode_path is None or self.compiled is None:
                    s.request.decode_path = path
                if s.request.decode_path == "compiled":
                    compiled.append(s)
                    num_compiled_rows += s.num_new_tokens
                    continue
            (eager if s.num_new_tokens == 1 or s.draft else prefill).append(s)
        return (SchedulerOutput(compiled + eager + prefill, out.preempted), len(compiled) + len(eager),
                num_compiled_rows)

    def execute(self, out: SchedulerOutput) -> dict[str, list[SampledToken]]:
        """Run one step; returns the new tokens of every request that reached its last token: one,
        or for a speculative step the accepted draft tokens and one more."""
        out, num_decode_entries, num_compiled = self.split(out)
        ids, pos, meta, rows = self.prepare(out, num_decode_entries)
        hidden = self.forward(ids, pos, meta, num_compiled)
        sampling = [s for s in out.scheduled if s.samples]
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[rows])
        plain, plain_rows, result, row = [], [], {}, 0
        for s in sampling:
            if s.draft:
                verified = self.sampler.verify(logits[row:row + len(s.draft) + 1], s.request, s.draft)
                result[s.request.request_id] = [SampledToken(t) for t in verified]
            else:
                plain.append(s.request)
                plain_rows.append(row)
            row += len(s.draft) + 1
        if plain:
            tokens = self.sampler.sample(logits if len(plain_rows) == row else logits[plain_rows], plain)
            result.update((r.request_id, [t]) for r, t in zip(plain, tokens))
        return result
