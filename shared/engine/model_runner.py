"""Turns a SchedulerOutput into tensors, runs the model, samples."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from shared.engine.sampler import SampledToken, Sampler
from shared.engine.scheduler import ScheduledRequest, SchedulerOutput
from shared.model.attention import AttentionBackend, AttentionMetadata
from shared.engine.compiled.step import CompiledDecode
from shared.engine.compiled.cuda_graph import GraphedDecode
from shared.model.llama import LayerState, LlamaModel

Interrupt = Callable[[int], bool]  # whether a request more urgent than this priority is on its way in


@dataclass
class SuspendedPart:
    """The eager part of a step, stopped between two layers for a more urgent request
    (``ModelRunner.execute``): its entries, where its forward is, their logits rows within it, the
    most urgent entry's priority, each entry's preemption count when it stopped (one preempted since
    holds other blocks, or none: the part cannot go on), and the seconds its layers ran so far."""

    entries: list[ScheduledRequest]
    state: LayerState
    meta: AttentionMetadata
    rows: list[int]
    priority: int
    num_preemptions: list[int]
    elapsed_s: float


class StepOrder(NamedTuple):
    """``ModelRunner.split``'s answer."""
    out: SchedulerOutput        # the step's entries in the order they run
    num_decode_entries: int     # the decode entries, first (compiled, then eager)
    num_compiled_entries: int   # of those, the compiled ones, first
    num_compiled_rows: int      # their rows


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, backend: AttentionBackend,
                 block_size: int, sampler: Sampler, compiled: CompiledDecode | GraphedDecode | None = None,
                 share: Callable[[CompiledDecode], object | None] | None = None) -> None:
        """``share``: a parallel group's, which has every rank take a compiled step handed over by the
        background compile (``use_compiled``) and returns rank 0's, or None where the group stays
        eager (``ParallelModel.share_compiled``)."""
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = block_size
        self.sampler = sampler
        self.device = model.device
        self.compiled = compiled  # runs the decode rows when set: the CPU's compiled step, or CUDA graphs
        self.suspended: SuspendedPart | None = None  # a step's eager part waiting to go on (``execute``)
        self._share = share
        self.pending: CompiledDecode | None = None  # a group's compiled step, handed over at the next step

    def use_compiled(self, compiled: CompiledDecode) -> None:
        """From the background compile: the engine thread's next decode-only step runs the graph. On a
        group, the engine thread's next step first hands it to every rank (``_hand_over``): the
        followers wait for rank 0's operations between steps only, and the background thread must
        not make collectives beside the engine thread's."""
        if self._share is None:
            self.compiled = compiled
        else:
            self.pending = compiled

    def _hand_over(self) -> None:
        """A group's pending compiled step to every rank, at the start of a step (every rank is
        between two operations): the step's first decode rows run it, unless a rank could not take
        it (``share`` said None: the group stays eager)."""
        compiled, self.pending = self.pending, None
        self.compiled = self._share(compiled)

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
        first, rest = _split_meta(meta, n)
        return torch.cat([self.compiled.forward(ids[:n], pos[:n], self.kv_cache, first),
                          self.model.forward(ids[n:], pos[n:], self.kv_cache, rest, self.backend)])

    def split(self, out: SchedulerOutput) -> StepOrder:
        """The step's entries in the order they run: the decode rows that run compiled, the other
        decode rows, then prefill chunks; and how many entries (and compiled rows) the groups hold.

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
            if s.decode_rows:
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
        return StepOrder(SchedulerOutput(compiled + eager + prefill, out.preempted), len(compiled) + len(eager),
                         len(compiled), num_compiled_rows)

    def execute(self, out: SchedulerOutput, interrupt: Interrupt | None = None) -> dict[str, list[SampledToken]]:
        """Run one step; returns the new tokens of every request that reached its last token: one,
        or for a speculative step the accepted draft tokens and one more.

        With ``interrupt``, the step's eager part (prefill chunks, and decode rows not compiled) runs
        a layer at a time and stops between two layers once ``interrupt(p)`` says a request more
        urgent than its most urgent entry (priority ``p``) is on its way: its compiled decode rows
        are sampled as usual, and the eager part waits in ``suspended`` for ``resume``."""
        if self.pending is not None:
            self._hand_over()
        order = self.split(out)
        out, n = order.out, order.num_compiled_rows
        ids, pos, meta, rows = self.prepare(out, order.num_decode_entries)
        if interrupt is None or n == ids.shape[0]:
            return self._sample(out.scheduled, self.forward(ids, pos, meta, n), rows)
        first, rest = _split_meta(meta, n) if n else (meta, meta)
        hidden = self.compiled.forward(ids[:n], pos[:n], self.kv_cache, first) if n else None
        done, part = out.scheduled[:order.num_compiled_entries], out.scheduled[order.num_compiled_entries:]
        priority = min(s.request.priority for s in part)
        state = self.model.start_layers(ids[n:], pos[n:])
        started = time.perf_counter()
        if self.model.run_layers(state, self.kv_cache, rest, self.backend, lambda: interrupt(priority)):
            tail = self.model.finish_layers(state, self.backend)
            return self._sample(out.scheduled, tail if hidden is None else torch.cat([hidden, tail]), rows)
        self.suspended = SuspendedPart(part, state, rest, [r - n for r in rows if r >= n], priority,
                                       [s.request.num_preemptions for s in part], time.perf_counter() - started)
        return self._sample(done, hidden, [r for r in rows if r < n]) if done else {}

    def resume(self, interrupt: Interrupt | None = None) -> dict[str, list[SampledToken]] | None:
        """Go on with the ``suspended`` part: its entries' tokens once its last layer ran, or None
        when ``interrupt`` stopped it again."""
        part = self.suspended
        started = time.perf_counter()
        done = self.model.run_layers(part.state, self.kv_cache, part.meta, self.backend,
                                     None if interrupt is None else lambda: interrupt(part.priority))
        part.elapsed_s += time.perf_counter() - started
        if not done:
            return None
        self.suspended = None
        return self._sample(part.entries, self.model.finish_layers(part.state, self.backend), part.rows)

    def _sample(self, entries: list[ScheduledRequest], hidden: torch.Tensor,
                rows: list[int]) -> dict[str, list[SampledToken]]:
        """The new tokens of ``entries``, whose logits rows are ``rows`` of ``hidden``."""
        sampling = [s for s in entries if s.samples]
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


def _split_meta(meta: AttentionMetadata, n: int) -> tuple[AttentionMetadata, AttentionMetadata]:
    """A step's metadata as two forwards': its first ``n`` rows (decode rows, one token each) and the rest."""
    starts = meta.step_starts
    first = AttentionMetadata(n, meta.slot_mapping[:n], meta.block_tables[:n], meta.seq_lens[:n],
                              meta.query_start_loc[:n + 1], int(meta.seq_lens[:n].max()), 1,
                              step_starts=None if starts is None else starts[:n])
    rest = AttentionMetadata(meta.num_decodes - n, meta.slot_mapping[n:], meta.block_tables[n:],
                             meta.seq_lens[n:], meta.query_start_loc[n:] - n, int(meta.seq_lens[n:].max()),
                             meta.max_query_len)
    return first, rest
