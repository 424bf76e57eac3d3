"""Continuous batching with chunked prefill under a token budget (SARATHI-style mixed steps).

Pure Python: the scheduler never touches tensors. Each step:
1. running requests, in priority order, each get their next tokens (one for a decode, a chunk for
   an unfinished prefill) until the token budget is spent; when blocks run out the lowest-priority
   running request is preempted (its blocks freed, it will recompute from its prefix cache);
2. if nothing was preempted for memory, waiting requests are admitted in (priority, arrival)
   order, reusing their cached prefix blocks, while budget, sequence slots and blocks last. When
   every slot is taken, a waiting request of higher priority first takes the slot of the
   lowest-priority running one (``_yield_slots``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.engine.errors import PromptTooLongError
from shared.engine.request import Request, RequestStatus
from shared.engine.speculative import Speculator
from shared.kvcache.manager import KVCacheManager


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) and max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) must be positive")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # the draft tokens included
    block_ids: list[int]
    start: int  # num_computed_tokens when scheduled: first position computed this step
    samples: bool = False  # this step reaches the request's last known token, so it yields a new one
    draft: list[int] = field(default_factory=list)  # speculative tokens computed after the last one

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_new_tokens - len(self.draft) == self.request.num_tokens

    @property
    def decode_rows(self) -> bool:
        """Whether this entry is decode rows: one output token (generated now or recomputed), or the
        last token with its draft, a row per token."""
        return (self.num_new_tokens == 1 or bool(self.draft)) and self.request.decodes_at(self.start)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # one-token entries first
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(frozen=True)
class Backlog:
    prefill_tokens: dict[int, int]  # priority -> tokens still to prefill
    num_waiting: dict[int, int]     # priority -> waiting requests
    num_running: dict[int, int] = field(default_factory=dict)  # priority -> running requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, namespace: bytes,
                 speculator: Speculator | None = None) -> None:
        self.config = config
        self.speculator = speculator
        self.kv = kv
        self.namespace = namespace
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []  # sorted by sort_key
        self.requests: dict[str, Request] = {}
        # decode side of remote prefill: blocks reserved, a prefill worker may be writing them
        self.remote: dict[str, Request] = {}
        # prefill side: finished with keep_kv, blocks held until a transfer has read them
        self.held: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- intake ---------------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int) -> None:
        """Raise PromptTooLongError if a prompt could never run (context or the whole pool)."""
        limit = self.config.max_model_len - 1
        if num_prompt_tokens > limit:
            raise PromptTooLongError(num_prompt_tokens, limit,
                                     f"the context of {self.config.max_model_len} tokens with room to generate")
        pool_tokens = self.kv.pool.num_blocks * self.kv.block_size - 1
        if num_prompt_tokens > pool_tokens:
            raise PromptTooLongError(num_prompt_tokens, pool_tokens, f"the KV cache of {pool_tokens + 1} tokens")

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.held or request.request_id in self.remote:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        self.check_fits(request.num_prompt_tokens)
        request.update_block_hashes(self.kv.block_size, self.namespace)
        self.kv.prefetch(request.block_hashes)
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request_id in self.remote:
            # a transfer may still be writing its blocks: they are freed by finish_remote
            request.status = RequestStatus.FINISHED_ABORTED
            del self.requests[request_id]
            return request
        self._remove(request, RequestStatus.FINISHED_ABORTED)
        return request

    def backlog(self) -> "Backlog":
        """By priority: tokens still to prefill (waiting requests, including preempted ones that
        recompute their output, and running prompts not fully computed; cached prefixes are not
        known before scheduling, so this errs high) and the number of waiting requests."""
        tokens: dict[int, int] = {}
        waiting: dict[int, int] = {}
        for r in self.waiting:
            tokens[r.priority] = tokens.get(r.priority, 0) + r.num_tokens - r.num_computed_tokens
            waiting[r.priority] = waiting.get(r.priority, 0) + 1
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                tokens[r.priority] = tokens.get(r.priority, 0) + r.num_prompt_tokens - r.num_computed_tokens
        running: dict[int, int] = {}
        for r in self.running:
            running[r.priority] = running.get(r.priority, 0) + 1
        return Backlog(tokens, waiting, running)

    # -- remote prefill -------------------------------------------------------------------------
    def reserve_remote(self, request: Request,
                       decide: Callable[[int], bool] | None = None) -> tuple[list[int], int] | None:
        """Take a request whose prompt KV another worker will write: allocate blocks for the whole
        prompt now, reusing the local cached prefix. Returns (block table, cached prompt tokens),
        or None (nothing changed) when ``decide(cached prompt tokens)`` is false or the pool
        cannot hold the prompt now."""
        if request.request_id in self.requests or request.request_id in self.held or request.request_id in self.remote:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        self.check_fits(request.num_prompt_tokens)
        request.update_block_hashes(self.kv.block_size, self.namespace)
        hits, num_hit = self.kv.find_cached_prefix(request.block_hashes, request.num_reusable_tokens)
        if decide is not None and not decide(num_hit):
            return None
        table = self.kv.allocate_slots(request.request_id, request.num_prompt_tokens, hits)
        if table is None:
            return None
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_cached_tokens = request.num_computed_tokens = num_hit
        self.requests[request.request_id] = request
        self.remote[request.request_id] = request
        return table, num_hit

    def finish_remote(self, request_id: str, kv_written: bool) -> Request | None:
        """The transfer into a reserved request's blocks is over (or given up on).

        ``kv_written``: the KV of the prompt's full blocks is in place, so their tokens count as
        computed; the partial tail block (and at least the last token, for its logits) is computed
        here. Otherwise the request prefills locally from its cached prefix. An aborted request's
        blocks are freed now (held, with ``keep_kv``). None if unknown."""
        request = self.remote.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.FINISHED_ABORTED:
            self._release_or_hold(request, request.status)
            return request
        if kv_written:
            # a greedy request's recomputed output is computed here, as decode rows (``prefill_end``)
            full = min(request.num_prompt_tokens, request.prefill_end) // self.kv.block_size * self.kv.block_size
            request.num_computed_tokens = max(request.num_computed_tokens, min(full, request.num_prompt_tokens - 1))
            # the received blocks are reusable (and announced) from now on, like computed ones
            self.kv.cache_computed(request_id, request.all_token_ids, request.block_hashes,
                                   request.num_computed_tokens)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=lambda r: r.sort_key)
        return request

    def release(self, request_id: str) -> bool:
        """Free a finished keep_kv request's blocks (its cached ones stay in the prefix cache)."""
        if self.held.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True

    def has_prompt_work_above(self, priority: int) -> bool:
        """Whether a request more urgent than ``priority`` waits, or runs with prompt left to compute."""
        return any(r.priority < priority for r in self.waiting) or any(
            r.priority < priority and not r.suspended and r.num_tokens - r.num_computed_tokens > 1
            for r in self.running)

    def decode_priority(self) -> float:
        """The most urgent priority among running requests with a decode row to compute (not those of a
        stopped step's part); inf when there is none."""
        return min((r.priority for r in self.running
                    if not r.suspended and r.num_tokens - r.num_computed_tokens == 1), default=math.inf)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Running requests first: every decode, and the prefill chunks of unfinished prompts in
        priority order; then waiting requests. A prefill chunk yields to waiting requests of a
        higher priority: they are admitted before it (a long low-priority prompt mid-prefill does
        not hold a premium prompt back for the rest of its chunks), and it takes what budget is
        left. With a single priority nothing yields and the order is arrival order."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        num_yielded = self._yield_slots(out)
        if self.speculator is not None:
            self.speculator.begin_step()
        top_waiting = self.waiting[0].priority if self.waiting else None
        yielding: list[Request] = []
        for request in list(self.running):
            if budget == 0:
                break
            # preempted earlier in this loop, or in a step stopped between two layers (it goes on later)
            if request.status is not RequestStatus.RUNNING or request.suspended:
                continue
            if (scheduled := self._speculate(request, budget)) is not None:
                out.scheduled.append(scheduled)
                budget -= scheduled.num_new_tokens
                continue
            if (top_waiting is not None and request.priority > top_waiting
                    and request.num_tokens - request.num_computed_tokens > 1):
                yielding.append(request)
                continue
            budget = self._schedule_running(request, budget, out)
        for request in yielding:  # each after the waiting requests that outrank it
            if len(out.preempted) == num_yielded:
                budget = self._admit_waiting(budget, out, below_priority=request.priority)
            if budget == 0:
                break
            if request.status is RequestStatus.RUNNING:
                budget = self._schedule_running(request, budget, out)
        if len(out.preempted) == num_yielded:  # no memory shortage this step
            budget = self._admit_waiting(budget, out)
        self._pause_lower_priorities(out)
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return out

    def schedule_decodes(self) -> SchedulerOutput:
        """A step of running requests' decode rows alone, between two slices of a stopped step's part
        (LLMEngine.step): no prompt chunk and no admission, which would make it as long as the wait it
        is for. No draft tokens either: a decode row's tokens do not depend on whether it speculates."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for request in list(self.running):
            if budget == 0:
                break
            if (request.status is RequestStatus.RUNNING and not request.suspended
                    and request.num_tokens - request.num_computed_tokens == 1):
                budget = self._schedule_running(request, budget, out)
        return out

    @staticmethod
    def _pause_lower_priorities(out: SchedulerOutput) -> None:
        """A step that prefills a prompt leaves out every row of a lower priority, decode rows and
        prefill chunks alike: they run the step after, and the higher-priority prompt's first token
        waits on none of their work (a batch tier's decode batch or prompt chunks would otherwise
        make every premium prefill step longer). Rows with draft tokens count as decode rows: a
        lower priority's are left out too (a draft is proposed again the step after; the blocks
        reserved for it stay the request's). With a single priority nothing is left out."""
        def is_decode(s: ScheduledRequest) -> bool:  # a recomputed output token counts as one too
            return s.num_new_tokens == 1 and s.start >= min(s.request.num_tokens - 1, s.request.prefill_end)

        prefills = [s.request.priority for s in out.scheduled if not s.draft and not is_decode(s)]
        if prefills:
            top = min(prefills)
            out.scheduled = [s for s in out.scheduled if s.request.priority <= top]

    def _schedule_running(self, request: Request, budget: int, out: SchedulerOutput) -> int:
        num_new = request.chunk(request.num_computed_tokens, budget)
        table = self._allocate_or_preempt(request, request.num_computed_tokens + num_new, out)
        if table is None:
            return budget
        out.scheduled.append(ScheduledRequest(request, num_new, table, request.num_computed_tokens))
        return budget - num_new

    def _speculate(self, request: Request, budget: int) -> ScheduledRequest | None:
        """A decode step with draft tokens, if the speculator proposes some and their blocks are
        free now (a draft never preempts anyone); None: schedule the request as usual."""
        if self.speculator is None or request.num_tokens - request.num_computed_tokens != 1 or budget < 2:
            return None
        draft = self.speculator.draft(request, len(self.running), self.config.max_model_len)[:budget - 1]
        if not draft:
            return None
        table = self.kv.allocate_slots(request.request_id, request.num_tokens + len(draft))
        if table is None:
            return None
        return ScheduledRequest(request, 1 + len(draft), table, request.num_computed_tokens, draft=draft)

    def _yield_slots(self, out: SchedulerOutput) -> int:
        """With every sequence slot taken, each waiting request of a higher priority than the
        lowest-priority running one takes that one's slot (it is preempted, and recomputes later
        mostly from its cached prefix). Returns how many were preempted."""
        num = 0
        while (len(self.running) >= self.config.max_num_seqs and num < len(self.waiting)
               and self.waiting[num].priority < self.running[-1].priority):
            victim = self._victim()
            self._preempt(victim)  # it sorts after the waiting requests that outrank it
            out.preempted.append(victim.request_id)
            num += 1
        return num

    def _allocate_or_preempt(self, request: Request, num_tokens: int, out: SchedulerOutput) -> list[int] | None:
        while True:
            table = self.kv.allocate_slots(request.request_id, num_tokens)
            if table is not None:
                return table
            victim = self.running[-1]  # lowest priority, latest arrival: not scheduled yet this step
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is request:
                return None

    def _victim(self) -> Request:
        """The running request that yields its slot: of those of the lowest priority, the latest to arrive
        that has its first token (preempting it costs it a recompute from its cached prefix, not its
        time to first token), else the latest to arrive. Taking the latest regardless starved a
        lower tier under a steady stream of a higher one: each slot it got was taken back before
        its first token, and requests admitted in the first seconds of a 40 s premium stream waited
        41 s for it."""
        lowest = self.running[-1].priority
        for request in reversed(self.running):
            if request.priority != lowest:
                break
            if request.output_token_ids:
                return request
        return self.running[-1]

    def _admit_waiting(self, budget: int, out: SchedulerOutput, below_priority: int | None = None) -> int:
        """Admit in order (only requests of a priority more urgent than ``below_priority``, if
        given); a request whose prefix is still being read from disk waits for it while the ones
        behind it go ahead."""
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[i]
            if below_priority is not None and request.priority >= below_priority:
                break  # waiting is sorted: no one further on is more urgent
            if self.kv.is_loading(request.block_hashes):
                i += 1
                continue
            # blocks past prefill_end were computed as someone's prefill: recompute them as decode rows
            hits, num_hit = self.kv.find_cached_prefix(request.block_hashes, request.num_reusable_tokens)
            num_new = request.chunk(num_hit, budget)
            table = self.kv.allocate_slots(request.request_id, num_hit + num_new, hits)
            if table is None:
                break
            self.waiting.pop(i)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.sort_key)
            out.scheduled.append(ScheduledRequest(request, num_new, table, num_hit))
            budget -= num_new
        return budget

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.suspended = False  # a suspended step of its is dropped (LLMEngine)
        self.kv.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    # -- results --------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance computed tokens, record sampled tokens (a speculative step: the accepted draft
        and one more), cache full blocks; return finished. A request that stops within the
        accepted tokens keeps only those up to its stop."""
        finished = []
        for s in out.scheduled:
            request = s.request
            if request.status is not RequestStatus.RUNNING:
                continue
            tokens = sampled.get(request.request_id) or []
            num_accepted = len(tokens) - 1 if s.draft else 0
            # the rejected draft tokens' KV is garbage: computed only up to the accepted ones
            request.num_computed_tokens += s.num_new_tokens - len(s.draft) + num_accepted
            if s.draft and self.speculator is not None:
                self.speculator.observe(request.request_id, len(s.draft), num_accepted)
            for token in tokens:
                request.append_token(token, self.config.max_model_len)
                if request.status.is_finished:
                    break
            # stopped inside the accepted draft: the KV past the last kept token is not its tokens'
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
            if tokens:
                request.update_block_hashes(self.kv.block_size, self.namespace)
            self.kv.cache_computed(request.request_id, request.all_token_ids, request.block_hashes,
                                   request.num_computed_tokens)
            if request.status.is_finished:
                self._remove(request, request.status)
                finished.append(request)
            elif not request.keep_kv:  # a kept request's blocks are read whole (a transfer sends them)
                self.kv.free_out_of_window(request.request_id, request.num_computed_tokens)
        return finished

    def _remove(self, request: Request, status: RequestStatus) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release_or_hold(request, status)
        self.requests.pop(request.request_id, None)

    def _release_or_hold(self, request: Request, status: RequestStatus) -> None:
        """A finished request's blocks go back to the pool, or, with ``keep_kv``, stay owned by it
        (whatever the reason it ended) until ``release``."""
        if request.keep_kv:
            self.held[request.request_id] = request
        else:
            self.kv.free(request.request_id)
        request.status = status
