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

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        logits_rows: list[int] = []
        max_blocks = max(len(s.block_ids) for s in out.scheduled)
        tables = []
        for s in out.scheduled:
            tokens = s.request.all_token_ids + s.draft if s.draft else s.request.all_token_ids
            end = s.start + s.num_new_tokens
            input_ids.extend(tokens[s.start:end])
            positions.extend(range(s.start, end))
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in range(s.start, end))
            seq_lens.append(end)
            query_start.append(query_start[-1] + s.num_new_tokens)
            if s.samples:  # the last token's row, and a speculative step's draft rows after it
                logits_rows.extend(range(query_start[-1] - 1 - len(s.draft), query_start[-1]))
            tables.append(s.block_ids + [0] * (max_blocks - len(s.block_ids)))
        dev = self.device
        meta = AttentionMetadata(
            num_decodes=out.num_decodes,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            max_seq_len=max(seq_lens),
            max_query_len=max(s.num_new_tokens for s in out.scheduled),
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
        first = AttentionMetadata(n, meta.slot_mapping[:n], meta.block_tables[:n], meta.seq_lens[:n],
                                  meta.query_start_loc[:n + 1], int(meta.seq_lens[:n].max()), 1)
        rest = AttentionMetadata(meta.num_decodes - n, meta.slot_mapping[n:], meta.block_tables[n:],
                                 meta.seq_lens[n:], meta.query_start_loc[n:] - n, int(meta.seq_lens[n:].max()),
                                 meta.max_query_len)
        return torch.cat([self.compiled.forward(ids[:n], pos[:n], self.kv_cache, first),
                          self.model.forward(ids[n:], pos[n:], self.kv_cache, rest, self.backend)])

    def split(self, out: SchedulerOutput) -> tuple[SchedulerOutput, int]:
        """The step's entries with those that run compiled first, and how many they are.

        A request's decode rows all run one way, fixed at its first one: compiled if the compiled
        step is there by then, else eager to its end (a request decoding when the background
        compile hands over does not change path). Decode rows run compiled also in a step that
        prefills another request, beside the eager prefill: the compiled step's sums differ from
        eager's in the last bits, which int8 rounding can carry into a token, so a request's tokens
        would otherwise depend on whether someone was prefilling beside it."""
        path = "eager" if self.compiled is None else "compiled"  # for a request's first decode row
        compiled, rest = [], []
        for s in out.scheduled:
            if s.num_new_tokens == 1 and s.request.decodes_at(s.start):  # a decode row
                if s.request.decode_path is None:
                    s.request.decode_path = path
                if s.request.decode_path == "compiled":
                    compiled.append(s)
                    continue
            rest.append(s)
        if not rest or not compiled:
            return out, len(compiled)
        return SchedulerOutput(compiled + rest, out.preempted), len(compiled)

    def execute(self, out: SchedulerOutput) -> dict[str, list[SampledToken]]:
        """Run one step; returns the new tokens of every request that reached its last token: one,
        or for a speculative step the accepted draft tokens and one more."""
        out, num_compiled = self.split(out)
        ids, pos, meta, rows = self.prepare(out)
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
