"""Simulated workers: one GPU group each, prefilling or decoding, timed by the cost model.

A decode worker is not stepped token by token: between batch changes every running sequence
advances one token per step, so the worker keeps a *virtual step counter* and each sequence the
counter value at which it finishes. Events happen only when a sequence joins or leaves (then the
step time is recomputed for the new batch), which keeps a million-request run to a few events
per request.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque

from shared.planner.config import ModelSpec
from shared.planner.costmodel import (Efficiency, GroupHardware, Parallel, decode_step_s,
                                      kv_capacity_tokens, prefill_latency_s, prefill_service_s)

PREFILL, DECODE = "prefill", "decode"


class Worker:
    __slots__ = ("index", "name", "role", "group", "hw", "prefill_par", "decode_par", "kv_capacity",
                 "kv_used", "finish_heap", "steps_done", "last_t", "stall_until", "step_time", "version",
                 "sum_ctx", "boundary_t", "waiting", "ingress_free", "egress_free", "cache", "cache_blocks", "draining", "busy_s",
                 "cache_shares_pool", "running_cached_blocks", "_block_size", "_model", "_eff")

    def __init__(self, index: int, name: str, role: str, group: list[int], hw: GroupHardware,
                 prefill_par: Parallel | None, decode_par: Parallel | None, model: ModelSpec,
                 eff: Efficiency, cache_block_size: int):
        self.index, self.name, self.role, self.group, self.hw = index, name, role, group, hw
        self.prefill_par, self.decode_par = prefill_par, decode_par
        self._model, self._eff = model, eff
        par = decode_par or prefill_par
        self.kv_capacity = max(kv_capacity_tokens(model, hw, par, eff), 0.0)
        self.kv_used = 0
        self.finish_heap: list[tuple[float, int]] = []   # (virtual step at which it finishes, request)
        self.steps_done = 0.0
        self.last_t = 0.0
        self.stall_until = 0.0      # local prefills pause decoding until then
        self.step_time = 0.0
        self.version = 0            # bumps on every reschedule; stale finish events are ignored
        self.sum_ctx = 0.0
        self.boundary_t = 0.0       # when the step in progress at the last stall ended
        self.waiting: deque[int] = deque()                 # admitted, waiting for KV memory
        self.ingress_free = 0.0     # inter-node KV transfers queue on this worker's NICs, inbound
        self.egress_free = 0.0      # ... and outbound
        self.cache: OrderedDict[int, None] = OrderedDict()  # prefix-cache block hashes, LRU order
        self.cache_blocks = int(self.kv_capacity // cache_block_size)
        # the prefix cache is the KV pool's free part, as in the engine: blocks of running requests
        # (kv_used) leave it that much less room, except their whole prompt blocks, which are cache
        # blocks themselves once prefilled (running_cached_blocks). False: a cache of its own (a
        # host tier of prefix_cache_blocks), which running requests do not shrink
        self.cache_shares_pool = True
        self.running_cached_blocks = 0
        self._block_size = cache_block_size
        self.draining = False
        self.busy_s = 0.0

    # --- prefill ---------------------------------------------------------------------------
    def prefill_times(self, tokens: int) -> tuple[float, float]:
        """(latency until the KV is ready, time until the worker can take the next prompt)."""
        par = self.prefill_par if self.role == PREFILL else self.decode_par
        return (prefill_latency_s(self._model, self.hw, par, self._eff, tokens),
                prefill_service_s(self._model, self.hw, par, self._eff, tokens))

    # --- decode timeline -------------------------------------------------------------------
    def advance(self, now: float) -> None:
        start = max(self.last_t, self.stall_until)
        if self.finish_heap and now > start and self.step_time > 0:
            self.steps_done += (now - start) / self.step_time
        self.last_t = max(self.last_t, now)

    def join(self, now: float, request: int, steps: int, ctx: float) -> None:
        self.advance(now)
        heapq.heappush(self.finish_heap, (self.steps_done + steps, request))
        self.sum_ctx += ctx

    def pop_finished(self, now: float) -> list[int]:
        self.advance(now)
        done = []
        while self.finish_heap and self.finish_heap[0][0] <= self.steps_done + 1e-6:
            done.append(heapq.heappop(self.finish_heap)[1])
        return done

    def stall(self, now: float, seconds: float) -> float:
        """Pause decoding for a local prefill; returns when the prefill ends. A decode step that is
        running when the prompt arrives finishes first (the engine schedules between steps), so the
        prefill starts at the next step boundary."""
        self.advance(now)
        start = max(self.stall_until, now)
        if self.finish_heap and self.step_time > 0 and now >= self.stall_until:
            done = math.floor(self.steps_done + 1e-9)
            if self.steps_done - done > 1e-9:
                start = now + (done + 1 - self.steps_done) * self.step_time
                self.steps_done = done + 1
        self.boundary_t = start
        self.stall_until = start + seconds
        return self.stall_until

    def next_finish(self, now: float) -> float | None:
        """Recompute the step time for the current batch; the time the next sequence finishes."""
        self.version += 1
        if not self.finish_heap:
            self.step_time = 0.0
            self.steps_done = 0.0
            return None
        batch = len(self.finish_heap)
        self.step_time = decode_step_s(self._model, self.hw, self.decode_par, self._eff, batch,
                                       self.sum_ctx / batch)
        ahead = self.finish_heap[0][0] - self.steps_done
        if ahead <= 1e-6:  # its last step was the one a stall let finish: it ends at that boundary
            return max(now, self.boundary_t)
        return max(now, self.stall_until) + ahead * self.step_time

    # --- prefix cache ----------------------------------------------------------------------
    def cache_insert(self, block_hashes: list[int], index: dict[int, set[int]]) -> None:
        for h in block_hashes:
            if h in self.cache:
                self.cache.move_to_end(h)
                continue
            self.cache[h] = None
            index.setdefault(h, set()).add(self.index)
            while self.cache and len(self.cache) > self._cache_room():
                old, _ = self.cache.popitem(last=False)
                owners = index.get(old)
                if owners is not None:
                    owners.discard(self.index)
                    if not owners:
                        del index[old]

    def _cache_room(self) -> int:
        """Blocks the prefix cache may hold now."""
        if not self.cache_shares_pool:
            return self.cache_blocks
        pinned = max(self.kv_used / self._block_size - self.running_cached_blocks, 0.0)
        return max(int(self.cache_blocks - pinned), 0)
