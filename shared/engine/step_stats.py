"""What the engine's steps measured: counters, the recent prefill rate, step observers, and the
``EngineStats`` snapshot built from them and the scheduler's state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from shared.engine.scheduler import Scheduler, SchedulerOutput
from shared.model.moe import ExpertLoad


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_cached_blocks: int
    max_num_seqs: int
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_generated_tokens: int
    num_remote_pending: int = 0  # reserved for remote prefill, KV not yet in place
    num_held: int = 0  # finished keep_kv requests whose blocks a transfer still reads
    # what admission needs to predict a new request's TTFT (see shared.policy.admission)
    queued_prefill_tokens: dict[int, int] = field(default_factory=dict)  # priority -> tokens not yet prefilled
    num_waiting_by_priority: dict[int, int] = field(default_factory=dict)
    num_running_by_priority: dict[int, int] = field(default_factory=dict)
    prefill_tokens_per_s: float | None = None  # recent prefill throughput; None until measured
    # recent prefill steps fitted to seconds per prompt token and per (prompt token x context token),
    # PrefillCost; None until the fit is determined
    prefill_cost_s: tuple[float, float] | None = None
    warmup_prefill_tokens_per_s: float | None = None  # measured in warm-up (see StepStats.forget_prefill_rate)
    kv_tiers: dict[str, float] = field(default_factory=dict)  # host/disk tier sizes and counters (KvTiers.stats)
    num_draft_tokens: int = 0  # speculative decoding: draft tokens computed
    num_accepted_tokens: int = 0  # of those, accepted
    decode_step: str = "eager"  # eager, compiling (background compile under way) or compiled
    expert_tokens: tuple[int, ...] = ()  # a mixture of experts: (token, expert) pairs per expert so far
    expert_imbalance: float | None = None  # the worst layer's busiest expert / its mean (1.0: even)


StepObserver = Callable[[int, int, float], None]  # sequences, tokens, seconds of one step


class PrefillRate:
    """Prefill throughput of recent steps (exponential average). A step's time includes the decodes
    batched with the chunk, so the rate errs low: predictions built on it err late, not early."""

    def __init__(self, min_tokens: int, weight: float = 0.3) -> None:
        self.min_tokens = min_tokens  # smaller chunks measure per-step overhead, not prefill speed
        self.weight = weight
        self.tokens_per_s: float | None = None

    def observe(self, num_tokens: int, elapsed_s: float) -> None:
        if num_tokens < self.min_tokens or elapsed_s <= 0:
            return
        rate = num_tokens / elapsed_s
        self.tokens_per_s = rate if self.tokens_per_s is None else \
            self.tokens_per_s + self.weight * (rate - self.tokens_per_s)

    def forget(self) -> None:
        """Back to not measured: the next observed step sets the rate afresh."""
        self.tokens_per_s = None


class PrefillCost:
    """A step's prefill time as ``a`` seconds per prompt token plus ``b`` per prompt token per token
    of context it attends to (``b`` is attention's share, which grows with the context: on one
    CPU thread SmolLM2 prefills a 256-token prompt at 866 tok/s and a 3,072-token one at 448), fitted
    to recent steps by least squares with older steps weighed down by ``decay`` each. A chunk of
    ``n`` tokens starting at position ``s`` attends to ``n (2s + n)`` token pairs over ``n`` tokens
    (up to a constant folded into ``b``), so a prompt of ``u`` uncached tokens after ``c`` cached
    ones takes ``a u + b u (2c + u)`` alone, however it is chunked. The steps' decode rows are in
    their time, as in ``PrefillRate``. ``coefficients`` is None until both are determined and
    positive (prompts of one length cannot tell them apart): then the rate is all there is."""

    def __init__(self, min_tokens: int, decay: float = 0.98) -> None:
        self.min_tokens = min_tokens
        self.decay = decay
        self._xx = [0.0, 0.0, 0.0]   # weighted sums of x1², x1·x2, x2²
        self._xy = [0.0, 0.0]        # of x1·y, x2·y

    def observe(self, num_tokens: int, attended: float, elapsed_s: float) -> None:
        if num_tokens < self.min_tokens or elapsed_s <= 0:
            return
        d, (x1, x2) = self.decay, (float(num_tokens), float(attended))
        self._xx = [d * self._xx[0] + x1 * x1, d * self._xx[1] + x1 * x2, d * self._xx[2] + x2 * x2]
        self._xy = [d * self._xy[0] + x1 * elapsed_s, d * self._xy[1] + x2 * elapsed_s]

    def coefficients(self) -> tuple[float, float] | None:
        s11, s12, s22 = self._xx
        det = s11 * s22 - s12 * s12
        if s11 <= 0 or det <= 1e-6 * s11 * s22:   # one prompt shape so far: ill-determined
            return None
        a = (s22 * self._xy[0] - s12 * self._xy[1]) / det
        b = (s11 * self._xy[1] - s12 * self._xy[0]) / det
        return (a, b) if a > 0 and b > 0 else None

    def forget(self) -> None:
        self._xx, self._xy = [0.0, 0.0, 0.0], [0.0, 0.0]


class StepStats:
    """Told about every step that ran the model (``record``, before the scheduler updates the
    requests) and the tokens it generated (``count_generated``); runs in the engine thread."""

    def __init__(self, block_size: int) -> None:
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.prefill_rate = PrefillRate(min_tokens=block_size)
        self.prefill_cost = PrefillCost(min_tokens=block_size)
        self.warmup_prefill_tokens_per_s: float | None = None
        self._observers: list[StepObserver] = []

    def add_observer(self, observe: StepObserver) -> None:
        """``observe(num_seqs, num_tokens, elapsed_s)`` after every step that ran the model, in the
        engine's thread (so it must be quick and thread-safe)."""
        self._observers.append(observe)

    def forget_prefill_rate(self, keep_as_warmup: bool = False) -> None:
        """Drop the prefill rate measured so far (warm-up's few short prompts on cold kernels, often
        while other processes load, measure a rate the worker's real work does not have). With
        ``keep_as_warmup`` it is first kept apart as the warm-up's rate: what admission predicts
        from until real prompts measure one, and what the autoscaler does not average in."""
        if keep_as_warmup:
            self.warmup_prefill_tokens_per_s = self.prefill_rate.tokens_per_s
        self.prefill_rate.forget()
        self.prefill_cost.forget()

    def record(self, out: SchedulerOutput, elapsed_s: float) -> None:
        chunks = [(s.start, s.num_new_tokens) for s in out.scheduled if s.start < s.request.num_prompt_tokens]
        num_prefill = sum(n for _, n in chunks)
        self.prefill_rate.observe(num_prefill, elapsed_s)
        self.prefill_cost.observe(num_prefill, sum(n * (2 * start + n) for start, n in chunks), elapsed_s)
        for observe in self._observers:
            observe(len(out.scheduled), sum(s.num_new_tokens for s in out.scheduled), elapsed_s)
        self.num_steps += 1
        for s in out.scheduled:  # a request's first chunk (not after a preemption) counts its prompt
            if s.start == s.request.num_cached_tokens and s.request.num_preemptions == 0:
                self.num_prompt_tokens += s.request.num_prompt_tokens
                self.num_cached_prompt_tokens += s.request.num_cached_tokens

    def count_generated(self, num_tokens: int) -> None:
        self.num_generated_tokens += num_tokens

    def snapshot(self, scheduler: Scheduler, max_num_seqs: int, kv_tiers: dict[str, float],
                 decode_step: str, experts: ExpertLoad | None = None) -> EngineStats:
        pool = scheduler.kv.pool
        backlog = scheduler.backlog()
        spec = scheduler.speculator
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            num_blocks_total=pool.num_blocks, num_blocks_used=pool.num_used_blocks,
            num_cached_blocks=pool.num_cached_blocks, max_num_seqs=max_num_seqs,
            num_preemptions=scheduler.num_preemptions, num_steps=self.num_steps,
            num_prompt_tokens=self.num_prompt_tokens, num_cached_prompt_tokens=self.num_cached_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens, num_remote_pending=len(scheduler.remote),
            num_held=len(scheduler.held), queued_prefill_tokens=backlog.prefill_tokens,
            num_waiting_by_priority=backlog.num_waiting, num_running_by_priority=backlog.num_running,
            prefill_tokens_per_s=self.prefill_rate.tokens_per_s, prefill_cost_s=self.prefill_cost.coefficients(),
            warmup_prefill_tokens_per_s=self.warmup_prefill_tokens_per_s, kv_tiers=kv_tiers,
            num_draft_tokens=spec.stats.num_drafted if spec else 0,
            num_accepted_tokens=spec.stats.num_accepted if spec else 0, decode_step=decode_step,
            expert_tokens=experts.tokens if experts else (), expert_imbalance=experts.imbalance if experts else None)
