"""LLMEngine: schedule → run → update, one step at a time (synchronous core).

Its parts are made by ``shared.engine.build`` from the config; the KV blocks other workers write
or read (remote prefill, peer fetch, lends) are ``reservations``' (shared.engine.reservations);
what the steps measured is ``step_stats``' (shared.engine.step_stats)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from shared.engine.build import build_parts, load_model
from shared.engine.config import EngineConfig
from shared.engine.errors import InvalidRequestError, InvalidSamplingParamsError
from shared.engine.parallel import ParallelModel
from shared.engine.outputs import EngineOutput, TokenLogprobs, make_output  # noqa: F401
from shared.engine.request import Request, RequestStatus, SamplingParams
from shared.engine.reservations import KvReservations, PrefixFetchSlot, RemotePrefillSlot  # noqa: F401
from shared.engine.sampler import SampledToken
from shared.engine.scheduler import SchedulerOutput
from shared.engine.step_stats import EngineStats, PrefillRate, StepObserver, StepStats  # noqa: F401
from shared.engine.step_trace import StepTrace
from shared.grammar import GrammarError, compile_grammar
from shared.kvcache.events import KvEventSink
from shared.model.compile_artifacts import ArtifactStore
from shared.model.llama import LlamaModel

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: LlamaModel, config: EngineConfig, *, tokenizer=None,
                 model_id: str = "model", eos_token_ids: frozenset[int] = frozenset(),
                 artifact_store: ArtifactStore | None = None) -> None:
        """``artifact_store``: where the cluster keeps compiled decode steps (a worker's NATS bucket),
        asked before compiling and offered what this engine compiles."""
        parts = build_parts(model, config, tokenizer=tokenizer, model_id=model_id, eos_token_ids=eos_token_ids,
                            artifact_store=artifact_store)
        self.model, self.config, self.tokenizer, self.model_id = model, config, tokenizer, model_id
        self.eos_token_ids, self.device, self.block_size = eos_token_ids, model.device, config.block_size
        self.max_model_len, self.kv_namespace = parts.max_model_len, parts.kv_namespace
        self.kv_spec, self.num_blocks, self.kv_cache = parts.kv_spec, parts.num_blocks, parts.kv_cache
        self.events, self.tiers, self.kv, self.scheduler = parts.events, parts.tiers, parts.kv, parts.scheduler
        self.backend, self.runner, self.background_compile = parts.backend, parts.runner, parts.background_compile
        self.reservations = KvReservations(self.scheduler, self._new_request)
        self.step_stats = StepStats(config.block_size)
        self.step_trace = StepTrace(config.step_trace) if config.step_trace else None
        # the most urgent priority of requests on their way in from another thread (AsyncEngine sets
        # it as they are posted and resets it once they are added): a step's prefill of a lower
        # priority stops between two layers for them (``prefill_yield``)
        self.urgent_pending = math.inf
        # the last stop of a step's part was for decode rows of a more urgent priority (``prefill_slice_ms``):
        # a step of decode rows alone runs before the part goes on
        self._decode_turn = False
        self._clock = time.perf_counter
        self._log_capacity()

    @classmethod
    def from_config(cls, config: EngineConfig, artifact_store: ArtifactStore | None = None) -> "LLMEngine":
        """Resolve the model name (fetching the default model if needed), load it and build on it."""
        loaded = load_model(config)
        return cls(loaded.model, loaded.config, tokenizer=loaded.tokenizer, model_id=loaded.model_id,
                   eos_token_ids=loaded.eos_token_ids, artifact_store=artifact_store)

    def _log_capacity(self) -> None:
        tokens = self.num_blocks * self.block_size
        gib = self.num_blocks * self.kv_spec.bytes_per_block / 2**30
        per_req = self.kv_spec.bytes_per_token * self.max_model_len / 2**20
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB %s, %d KiB/token); a %d-token request "
                 "needs %.1f MiB, so at most %d such sequences run at once (max_num_seqs=%d); %s attention",
                 self.num_blocks, self.block_size, tokens, gib, str(self.kv_spec.dtype).removeprefix("torch."),
                 self.kv_spec.bytes_per_token // 1024,
                 self.max_model_len, per_req, tokens // self.max_model_len, self.config.max_num_seqs,
                 self.backend.name)

    # -- requests -------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise an InvalidRequestError subclass naming the field; safe from any thread."""
        vocab = self.model.cfg.vocab_size
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty", field="prompt")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", field="prompt")
        params.validate(vocab)
        if params.grammar is not None:
            if self.runner.sampler.grammars is None:
                raise InvalidSamplingParamsError("structured output needs the model's tokenizer", field="grammar")
            try:
                compile_grammar(params.grammar)
            except GrammarError as exc:
                raise InvalidSamplingParamsError(str(exc), field="grammar") from None
        self.scheduler.check_fits(len(prompt_token_ids))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, *, keep_kv: bool = False, deadline: float | None = None) -> None:
        """Queue a request. ``keep_kv``: when it finishes, hold its blocks
        (``reservations.request_block_ids`` stays valid) until ``reservations.release_kv`` — the
        prefill side of a KV transfer. ``deadline`` (Unix seconds): within its priority, earlier
        deadlines run first (none: after every deadline)."""
        self.scheduler.add_request(self._new_request(request_id, prompt_token_ids, params, priority, keep_kv,
                                                     deadline))

    def _new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                     keep_kv: bool, deadline: float | None) -> Request:
        self.validate(prompt_token_ids, params)
        return Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, priority,
                       keep_kv=keep_kv, deadline=math.inf if deadline is None else deadline,
                       decode_path=params.decode_path)

    def abort_request(self, request_id: str) -> EngineOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        self._forget(request_id)
        return make_output(request, [])

    def has_unfinished_requests(self) -> bool:
        """Requests that need steps (waiting or running; not those waiting for remote KV)."""
        return self.scheduler.has_unfinished

    # -- stepping -------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One step: a suspended step's part goes on first unless a more urgent prompt is to be
        computed (``_resume``), or it stopped for decode rows, which then run alone first; else the
        scheduler's next step, whose prefill of a lower priority may stop between two layers when a
        more urgent request arrives or when more urgent decode rows have waited ``prefill_slice_ms``
        for it (``prefill_yield``)."""
        if self.runner.suspended is not None:
            if self._decode_turn:
                self._decode_turn = False
                if (out := self.scheduler.schedule_decodes()).scheduled:
                    return self._update(*self._run(out))
            if (resumed := self._resume()) is not None:
                return resumed
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.runner.suspended is not None:  # nothing else can run: it goes on
                return self._resume(force=True) or []
            self._idle()
            return []
        out, sampled = self._run(out)
        return self._update(out, sampled)

    def _update(self, out: SchedulerOutput, sampled: dict[str, list[SampledToken]]) -> list[EngineOutput]:
        num_before = {s.request.request_id: len(s.request.output_token_ids) for s in out.scheduled}
        finished = self.scheduler.update_from_output(out, {rid: [t.token_id for t in tokens]
                                                           for rid, tokens in sampled.items()})
        return self._outputs(out, sampled, num_before, {r.request_id for r in finished})

    def _idle(self) -> None:
        if self.tiers is not None:  # requests may be waiting for their prefix from disk
            self.tiers.wait_loading(0.01)

    def _interrupt(self, decode_priority: float) -> Callable[[int], bool] | None:
        """What a step's part asks between two layers (its most urgent priority ``p``): stop when a
        request more urgent than ``p`` is on its way in, or when decode rows more urgent than ``p``
        (``decode_priority``) have waited ``prefill_slice_ms`` since the step began; None without
        ``prefill_yield``."""
        if not self.config.prefill_yield:
            return None
        self._decode_turn = False
        slice_s = self.config.prefill_slice_ms / 1000 if decode_priority < math.inf else 0.0
        deadline = self._clock() + slice_s

        def interrupt(priority: int) -> bool:
            if self.urgent_pending < priority:
                return True
            if slice_s > 0 and decode_priority < priority and self._clock() >= deadline:
                self._decode_turn = True
                return True
            return False
        return interrupt

    def _run(self, out: SchedulerOutput) -> tuple[SchedulerOutput, dict[str, list[SampledToken]]]:
        """Run a step: what of it ran to the end (the entries of a part that stopped are left out,
        marked ``suspended``) and their tokens."""
        now = time.monotonic()
        for s in out.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        interrupt = None if self.runner.suspended is not None else self._interrupt(min(
            (s.request.priority for s in out.scheduled if s.decode_rows), default=math.inf))
        started = time.perf_counter()
        sampled = self.runner.execute(out, interrupt)
        elapsed = time.perf_counter() - started
        part = self.runner.suspended if interrupt is not None else None
        if part is not None:
            for s in part.entries:
                s.request.suspended = True
            paused, out = part.entries, SchedulerOutput([s for s in out.scheduled if not s.request.suspended],
                                                        out.preempted)
            log.debug("step stopped after layer %d of %d for %s more urgent than priority %d",
                      part.state.next_layer, len(self.model.layers),
                      "decode rows" if self._decode_turn else "a request", part.priority)
        if out.scheduled:  # the stopped part's time is recorded when it ends (``_resume``)
            self.step_stats.record(out, elapsed - (part.elapsed_s if part is not None else 0.0))
        if self.step_trace is not None:
            self.step_trace.record(now, elapsed, out, paused if part is not None else ())
        return out, sampled

    def _resume(self, force: bool = False) -> list[EngineOutput] | None:
        """Go on with the suspended part unless a more urgent prompt is to be computed first (with
        ``force``: whatever waits). None: it did not run; [] (or no output yet): it stopped again."""
        part = self.runner.suspended
        if not all(s.request.status is RequestStatus.RUNNING and s.request.num_preemptions == n
                   for s, n in zip(part.entries, part.num_preemptions)):
            # one of its requests was aborted or preempted, so its blocks may be another's now: the
            # part's work is dropped, and its other requests compute those tokens again
            for s in part.entries:
                s.request.suspended = False
            self.runner.suspended = None
            log.debug("a suspended step's part was dropped: one of its requests ended or was preempted")
            return None
        if not force and self.scheduler.has_prompt_work_above(part.priority):
            return None
        now, started = time.monotonic(), time.perf_counter()
        sampled = self.runner.resume(self._interrupt(self.scheduler.decode_priority()))
        elapsed = time.perf_counter() - started
        out = SchedulerOutput(part.entries)
        if sampled is None:
            if self.step_trace is not None:
                self.step_trace.record(now, elapsed, SchedulerOutput(), part.entries)
            return []
        for s in part.entries:
            s.request.suspended = False
        self.step_stats.record(out, part.elapsed_s)
        if self.step_trace is not None:
            self.step_trace.record(now, elapsed, out)
        return self._update(out, sampled)

    def _outputs(self, out: SchedulerOutput, sampled: dict[str, list[SampledToken]], num_before: dict[str, int],
                 finished: set[str]) -> list[EngineOutput]:
        outputs = []
        for s in out.scheduled:
            rid = s.request.request_id
            tokens = sampled.get(rid)
            if not tokens:
                continue
            new_ids = s.request.output_token_ids[num_before[rid]:]
            self.step_stats.count_generated(len(new_ids))
            if rid in finished:
                self._forget(rid)
            outputs.append(make_output(s.request, new_ids, tokens[0] if len(tokens) == 1 else None))
        return outputs

    def _forget(self, request_id: str) -> None:
        self.runner.sampler.forget(request_id)
        if self.scheduler.speculator is not None:
            self.scheduler.speculator.forget(request_id)

    def stats(self) -> EngineStats:
        return self.step_stats.snapshot(self.scheduler, self.config.max_num_seqs,
                                        self.tiers.stats() if self.tiers is not None else {}, self.decode_step())

    def decode_step(self) -> str:
        """How decode-only steps run now: eager, compiling (eager while the background compile runs)
        or compiled."""
        if self.runner.compiled is not None:
            return "compiled"
        compiling = self.background_compile is not None and not self.background_compile.done.is_set()
        return "compiling" if compiling else "eager"

    def add_kv_event_sink(self, sink: KvEventSink) -> None:
        """Events go to ``sink`` from now on; the first sink also hears what the disk tier already
        holds (blocks a previous run of this worker left there)."""
        self.events.add_sink(sink)
        if self.tiers is not None and len(self.events.sinks) == 1:
            self.tiers.announce_disk()

    def close(self) -> None:
        """Write the pool's reusable blocks to the disk tier (if any) so a restart on the same
        directory finds them, finish queued writes and stop the tier threads; close the step trace;
        stop the other ranks of a tensor-parallel group."""
        if self.tiers is not None:
            num = self.tiers.persist(self.kv.pool.cached_blocks())
            if num:
                log.info("KV disk tier: saving %d cached blocks before exit", num)
            self.tiers.close()
        if self.step_trace is not None:
            self.step_trace.close()
        if isinstance(self.model, ParallelModel):
            self.model.close()

    # -- convenience ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 *, priorities: list[int] | None = None) -> list[list[int]]:
        """Run prompts to completion together (continuous batching); returns output token ids."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for i, (rid, prompt) in enumerate(zip(ids, prompts)):
            self.add_request(rid, prompt, params_list[i], priorities[i] if priorities else 0)
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished_requests():
            for o in self.step():
                if o.request_id in outputs:
                    outputs[o.request_id].extend(o.new_token_ids)
        return [outputs[rid] for rid in ids]


def warmup(engine: LLMEngine, num_tokens: int = 64) -> None:
    """Run a throwaway request so the first user request pays no first-run costs."""
    prompt = [i % engine.model.cfg.vocab_size for i in range(1, min(num_tokens, engine.max_model_len - 4))]
    with torch.inference_mode():
        engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
